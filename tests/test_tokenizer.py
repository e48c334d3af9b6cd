"""The tokenizer rebuilt from tokenizer.ggml.* keys: llama.cpp as the judge (its own test vectors and ids
recorded from it for varied texts in every vocabulary kind), round trips,
special tokens, chat templates and refusals."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from muser_mlx import gguf
from muser_mlx.testing import bpe_tokenizer_metadata, spm_tokenizer_metadata
from muser_mlx.tokenizer import ChatTemplateError, GGUFTokenizer, StreamingDetokenizer, TokenizerError

VOCAB_CACHE = Path.home() / ".cache" / "muser_mlx" / "llama-cpp-vocab"
# llama.cpp's tokenizer test vocabularies (each with .inp texts and .out ids) that cover the
# kinds we build: SentencePiece (llama), and byte-level BPE with four pre-tokenizers.
VOCABS = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2", "starcoder"]

TEXTS = [
    "Hello world", "  leading and trailing spaces  ", "tabs\tand\nnew\n\nlines\r\n",
    "digits 1234567890 and 3.14159", "café naïve Ærøskøbing", "日本語のテキストと中文",
    "emoji 🦙🎉👩‍💻", "def f(x):\n    return x ** 2  # code", "<|not a special token|>", "a" * 300,
]


def llama_cpp_vocab_folder() -> Path:
    """The ggml-vocab-*.gguf files and their cases, from llama-cpp-python's source
    distribution (fetched once with pip into ~/.cache; a download, not a dependency).
    Raises RuntimeError if they cannot be fetched."""
    if not all((VOCAB_CACHE / f"ggml-vocab-{v}.gguf.out").exists() for v in VOCABS):
        VOCAB_CACHE.mkdir(parents=True, exist_ok=True)
        download = VOCAB_CACHE / "sdist"
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "-q", "-d", str(download), "llama-cpp-python==0.3.36"], capture_output=True, text=True)
        archives = list(download.glob("llama_cpp_python-*.tar.gz"))
        if result.returncode or not archives:
            raise RuntimeError(f"llama-cpp-python's sdist could not be downloaded: {result.stderr[-300:]}")
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                name = Path(member.name).name
                if any(name.startswith(f"ggml-vocab-{v}.gguf") for v in VOCABS):
                    (VOCAB_CACHE / name).write_bytes(archive.extractfile(member).read())
        for archive in archives:
            archive.unlink()
    return VOCAB_CACHE


@pytest.fixture(scope="session")
def llama_cpp_vocabs():
    try:
        return llama_cpp_vocab_folder()
    except RuntimeError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def file_tokenizer():
    """path -> GGUFTokenizer of that file, each built once per module (Gemma 3's takes seconds)."""
    return functools.cache(lambda path: GGUFTokenizer(gguf.read(path).metadata))


def read_cases(folder: Path, vocab: str):
    texts = (folder / f"ggml-vocab-{vocab}.gguf.inp").read_text(encoding="utf-8")
    ids = (folder / f"ggml-vocab-{vocab}.gguf.out").read_text().split("\n")
    texts = texts.split("\n__ggml_vocab_test__\n")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids)]


@pytest.mark.parametrize("vocab", VOCABS)
def test_ids_match_llama_cpp_test_vectors(llama_cpp_vocabs, file_tokenizer, vocab):
    tokenizer = file_tokenizer(llama_cpp_vocabs / f"ggml-vocab-{vocab}.gguf")
    cases = read_cases(llama_cpp_vocabs, vocab)
    assert len(cases) > 40
    for text, expected in cases:
        assert tokenizer.encode(text, add_special_tokens=False) == expected, repr(text)


@pytest.mark.parametrize("vocab", VOCABS)
def test_round_trips_on_varied_text(llama_cpp_vocabs, file_tokenizer, vocab):
    tokenizer = file_tokenizer(llama_cpp_vocabs / f"ggml-vocab-{vocab}.gguf")
    for text in TEXTS:
        decoded = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
        # SentencePiece with a space prefix drops the one leading space it added.
        assert decoded == text, repr(text)


# --- llama.cpp as the judge: ids recorded from its tokenizer (tests/data/record_llama_cpp_tokens.py)
# for varied texts in every vocabulary kind we build. Llama 3's vocabulary under "llama4" stands
# for Muse Glimmer's pre-tokenizer; tiny-* are the vocabularies of muser_mlx.testing's models.
JUDGED = json.loads((Path(__file__).parent / "data" / "llama_cpp_tokens.json").read_text(encoding="utf-8"))
LLAMA_CPP_JUDGED = ["llama-spm", "llama-bpe", "qwen2"]  # of VOCABS


def llama4_metadata(llama_bpe: dict) -> dict:
    """The tokenizer keys of Llama 3's vocabulary with Muse Glimmer's llama4 pre-tokenizer."""
    return {**{k: v for k, v in llama_bpe.items() if k.startswith("tokenizer.")}, "tokenizer.ggml.pre": "llama4"}


@pytest.fixture(scope="module", params=sorted(JUDGED["vocabularies"]))
def judged(request, file_tokenizer):
    """(vocabulary name, our tokenizer of it, what llama.cpp recorded for it)."""
    name = request.param
    if name in ("smollm2", "gemma3"):
        tokenizer = file_tokenizer(request.getfixturevalue(f"{name}_path"))
    elif name in LLAMA_CPP_JUDGED:
        tokenizer = file_tokenizer(request.getfixturevalue("llama_cpp_vocabs") / f"ggml-vocab-{name}.gguf")
    elif name == "llama4":
        folder = request.getfixturevalue("llama_cpp_vocabs")
        tokenizer = GGUFTokenizer(llama4_metadata(gguf.read(folder / "ggml-vocab-llama-bpe.gguf").metadata))
    else:
        tokenizer = GGUFTokenizer({"tiny-llama4": lambda: bpe_tokenizer_metadata(pre="llama4"),
                                   "tiny-spm": spm_tokenizer_metadata}[name]())
    return name, tokenizer, JUDGED["vocabularies"][name]


def test_llama_cpp_judged_every_vocabulary_kind():
    assert set(JUDGED["vocabularies"]) == {"smollm2", "gemma3", "llama4", "tiny-llama4", "tiny-spm",
                                           *LLAMA_CPP_JUDGED}
    assert len(JUDGED["texts"]) >= 80


def test_ids_match_llama_cpp_on_varied_texts(judged):
    name, tokenizer, recorded = judged
    for text, expected in zip(JUDGED["texts"], recorded["ids"], strict=True):
        assert tokenizer.encode(text, add_special_tokens=False) == expected, f"{name}: {text!r}"


def test_decoded_text_matches_llama_cpp(judged):
    """Including what a SentencePiece vocabulary does with its own space mark: '▁' is read as
    the space piece and comes back as ' ' (llama.cpp's answer)."""
    name, tokenizer, recorded = judged
    for ids, expected in zip(recorded["ids"], recorded["decoded"], strict=True):
        assert tokenizer.decode(ids) == expected, f"{name}: {ids}"


def test_special_token_texts_parse_as_llama_cpp_parses_them(judged):
    name, tokenizer, recorded = judged
    for text, expected in zip(JUDGED["special_texts"], recorded["special_ids"], strict=True):
        assert tokenizer.encode(text, add_special_tokens=False, parse_special=True) == expected, f"{name}: {text!r}"


@pytest.fixture(params=["bpe", "spm"])
def tiny_tokenizer(request):
    metadata = bpe_tokenizer_metadata() if request.param == "bpe" else spm_tokenizer_metadata()
    return GGUFTokenizer(metadata)


def test_tiny_vocabularies_round_trip_any_text(tiny_tokenizer):
    for text in TEXTS:
        assert tiny_tokenizer.decode(tiny_tokenizer.encode(text, add_special_tokens=False)) == text


def test_bos_is_added_only_where_the_file_says_so():
    metadata = bpe_tokenizer_metadata()
    with_bos = GGUFTokenizer(metadata)
    without = GGUFTokenizer({**metadata, "tokenizer.ggml.add_bos_token": False})
    assert with_bos.encode("the fox")[0] == with_bos.bos_token_id
    assert with_bos.encode("the fox", add_special_tokens=False)[0] != with_bos.bos_token_id
    assert without.encode("the fox") == with_bos.encode("the fox")[1:]


def test_special_tokens_in_text_are_parsed_only_when_asked(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    text = f"a{tiny_tokenizer.tokens[eos]}b"
    assert eos in tiny_tokenizer.encode(text, add_special_tokens=False, parse_special=True)
    plain = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert eos not in plain
    assert tiny_tokenizer.decode(plain) == text


def test_every_special_token_in_user_text_stays_text_by_default(tiny_tokenizer):
    specials = [tiny_tokenizer.tokens[i] for i in sorted(tiny_tokenizer.special_ids)]
    text = " ".join(specials)
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert not set(ids) & tiny_tokenizer.special_ids
    assert tiny_tokenizer.decode(ids) == text


def test_end_of_generation_ids_include_eos_and_eot():
    tokenizer = GGUFTokenizer(bpe_tokenizer_metadata())
    assert tokenizer.tokens.index("<|end_of_text|>") in tokenizer.eos_token_ids
    assert tokenizer.tokens.index("<|eot|>") in tokenizer.eos_token_ids
    assert tokenizer.tokens.index("<|eom|>") not in tokenizer.eos_token_ids


def test_chat_template_renders_the_files_template():
    tokenizer = GGUFTokenizer(bpe_tokenizer_metadata())
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == ("<|begin_of_text|><|start|>system<|message|>be brief<|eot|><|start|>user"
                    "<|message|>hi<|eot|><|start|>assistant")
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.tokens.index("<|eot|>") in ids


def test_chat_without_a_template_is_a_clear_error():
    tokenizer = GGUFTokenizer(spm_tokenizer_metadata())
    with pytest.raises(ChatTemplateError, match="no tokenizer.chat_template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_that_raises_is_a_clear_error():
    metadata = {**bpe_tokenizer_metadata(), "tokenizer.chat_template": "{{ raise_exception('no system role') }}"}
    with pytest.raises(ChatTemplateError, match="no system role"):
        GGUFTokenizer(metadata).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("key, value, message", [
    ("tokenizer.ggml.model", "wordpiece9", "tokenizer.ggml.model 'wordpiece9'"),
    ("tokenizer.ggml.pre", "mystery", "tokenizer.ggml.pre 'mystery'"),
    ("tokenizer.ggml.merges", ["zz qq"], "merges has 'zz qq'"),
    ("tokenizer.ggml.bos_token_id", 10**6, "bos_token_id = 1000000"),
])
def test_bad_tokenizer_metadata_is_refused_by_name(key, value, message):
    with pytest.raises(TokenizerError, match=message):
        GGUFTokenizer({**bpe_tokenizer_metadata(), key: value})


def test_missing_tokens_are_refused():
    metadata = bpe_tokenizer_metadata()
    del metadata["tokenizer.ggml.tokens"]
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        GGUFTokenizer(metadata)


def test_decode_refuses_ids_outside_the_vocabulary(tiny_tokenizer):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_tokenizer.decode([0, tiny_tokenizer.vocab_size])


def test_streaming_text_holds_back_split_characters_and_adds_up(tiny_tokenizer):
    text = "café 日本 🦙 the fox"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    stream = StreamingDetokenizer(tiny_tokenizer)
    pieces = [stream.add_token(i) for i in ids] + [stream.finalize()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_smollm2_prompt_ids(smollm2_path, file_tokenizer):
    tokenizer = file_tokenizer(smollm2_path)
    ids = tokenizer.encode("The capital of France is")
    assert tokenizer.decode(ids) == "The capital of France is"
    assert tokenizer.bos_token_id not in ids  # add_bos_token is False in this file


def test_gemma3_adds_bos_and_round_trips(gemma3_path, file_tokenizer):
    tokenizer = file_tokenizer(gemma3_path)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids[1:]) == text


def test_gemma3_keeps_runs_of_spaces_whole_as_llama_cpp_does(gemma3_path, file_tokenizer):
    """Gemma's user-defined tokens (runs of spaces, ids 138 and 139 for two and three) are
    matched in the raw text before the SentencePiece merges, as llama.cpp partitions it."""
    tokenizer = file_tokenizer(gemma3_path)
    pieces = lambda text: [tokenizer.tokens[i] for i in tokenizer.encode(text, add_special_tokens=False)]
    assert tokenizer.encode("a  word", add_special_tokens=False)[1] == 138
    assert pieces("a  word") == ["a", "  ", "word"]
    assert pieces("x = 1   # note") == ["x", "▁=", "▁", "1", "   ", "#", "▁note"]
    assert pieces("  hi  ") == ["  ", "hi", "  "]


def test_token_bytes_add_up_to_the_decoded_text(judged):
    """A server's per-token logprobs carry each token's bytes: one after another they spell what
    llama.cpp decodes (but the space a SentencePiece vocabulary's decoding strips first)."""
    name, tokenizer, recorded = judged
    for ids, expected in zip(recorded["ids"], recorded["decoded"], strict=True):
        joined = b"".join(tokenizer.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
        if getattr(tokenizer, "space_prefix", False) and joined.startswith(" "):
            joined = joined[1:]
        assert joined == expected, f"{name}: {ids}"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.token_bytes(tokenizer.vocab_size)
