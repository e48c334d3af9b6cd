"""The tokenizer a GGUF file describes, rebuilt from its `tokenizer.ggml.*` keys.

Two kinds, as llama.cpp reads them:
- `gpt2`: byte-level BPE (vocabulary + merges). `tokenizer.ggml.pre` picks the regular
  expressions that split text into words before merging; each is the pattern of the model's
  own tokenizer.json, applied in sequence the way llama.cpp applies them.
- `llama`: SentencePiece-style BPE (vocabulary + scores, no merges): pieces merge by score,
  spaces become "▁", characters missing from the vocabulary fall back to <0xXX> byte tokens.

The merging itself is Hugging Face `tokenizers` (a compiled, well-tested BPE), configured
from the file. Chat templates are rendered with jinja2's sandbox, as transformers does.
"""

from __future__ import annotations

import threading
from datetime import datetime

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers


class TokenizerError(ValueError):
    """The file's tokenizer cannot be built: missing keys, unknown model or pre-tokenizer."""


class ChatTemplateError(TokenizerError):
    pass


# Token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
          r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# GPT-4o's pattern (Llama 4's, Muse Glimmer's) as llama.cpp rewrites it: "upper" is any letter
# but a-z and "lower" any letter but A-Z (so a non-ASCII letter is both), and no \p{M}.
_GPT4O = (r"""[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"""
          r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?"""
          r"""((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|"""
          r"""'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# tokenizer.ggml.pre -> (split patterns applied in order, whether a word found whole in the
# vocabulary skips merging: llama.cpp's ignore_merges, as Llama 3's tokenizer does).
PRE_TOKENIZERS = {
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"], False),
    "gpt-2": ([_GPT2], False),
    "gpt2": ([_GPT2], False),
    "smollm": ([r"\p{N}", _GPT2], False),
    "starcoder": ([r"\p{N}", _GPT2], False),
    "refact": ([r"\p{N}", _GPT2], False),
    "llama3": ([_LLAMA3], True),
    "llama-bpe": ([_LLAMA3], True),
    "llama-v3": ([_LLAMA3], True),
    "qwen2": ([_QWEN2], False),
    "llama4": ([_GPT4O], False),
    "gpt-4o": ([_GPT4O], False),
}

# Token texts that end generation: llama.cpp's list (llama-vocab.cpp), which also makes each of
# these a control token whatever type the file gives it (e.g. Gemma 3's user-defined "</s>"),
# and Muse Glimmer's "<|eot|>".
END_OF_GENERATION_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
                           "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
                           "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
                           "<｜end▁of▁sentence｜>", "<|eot|>"}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the alphabet of byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


class GGUFTokenizer:
    """encode / decode / apply_chat_template over one GGUF file's vocabulary."""

    def __init__(self, metadata: dict):
        self.metadata = metadata
        self.kind = self._require(metadata, "tokenizer.ggml.model", str)
        self.tokens: list[str] = self._require(metadata, "tokenizer.ggml.tokens", list, str)
        if not self.tokens:
            raise TokenizerError("tokenizer.ggml.tokens is empty")
        self.token_types = self._optional("tokenizer.ggml.token_type", [NORMAL] * len(self.tokens), list, int)
        if len(self.token_types) != len(self.tokens):
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(self.token_types)} entries for "
                                 f"{len(self.tokens)} tokens")
        self.token_types = [CONTROL if token in END_OF_GENERATION_TEXTS else kind
                            for token, kind in zip(self.tokens, self.token_types)]
        self.bos_token_id = self._token_id("bos")
        self.eos_token_id = self._token_id("eos")
        self.add_bos = self._optional("tokenizer.ggml.add_bos_token", self.kind == "llama", bool)
        if self.add_bos and self.bos_token_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is set but the file has no "
                                 "tokenizer.ggml.bos_token_id")
        if self.kind == "gpt2":
            self._tokenizer = self._byte_level_bpe()
        elif self.kind == "llama":
            self._tokenizer = self._sentencepiece_bpe()
        else:
            raise TokenizerError(f"tokenizer.ggml.model {self.kind!r} is not supported "
                                 f"(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
        # As llama.cpp partitions text: user-defined tokens (Gemma's runs of spaces and newlines,
        # HTML tags) are always matched whole in the raw text, before normalization; control
        # tokens only when special-token texts are parsed (encode's parse_special).
        self.special_ids = {i for i, t in enumerate(self.token_types) if t in (CONTROL, USER_DEFINED)}
        self._tokenizer.add_special_tokens([AddedToken(self.tokens[i], special=True, normalized=False)
                                            for i in sorted(self.special_ids) if self.token_types[i] == CONTROL])
        self._tokenizer.add_tokens([AddedToken(self.tokens[i], special=False, normalized=False)
                                    for i in sorted(self.special_ids) if self.token_types[i] == USER_DEFINED])
        self.eos_token_ids = self._end_of_generation_ids()
        self.chat_template = self._optional("tokenizer.chat_template", None, str)
        self._lock = threading.Lock()  # encode_special_tokens is a setting of the shared object

    @staticmethod
    def _require(metadata, key, kind, item_kind=None):
        if key not in metadata:
            raise TokenizerError(f"metadata key {key!r} is required to build the tokenizer")
        return GGUFTokenizer._typed(key, metadata[key], kind, item_kind)

    def _optional(self, key, default, kind, item_kind=None):
        if key not in self.metadata:
            return default
        return self._typed(key, self.metadata[key], kind, item_kind)

    @staticmethod
    def _typed(key, value, kind, item_kind=None):
        """value, checked to be a `kind` (of `item_kind` items); bools are not ints here."""
        def fits(v, k):
            return isinstance(v, k) and not (k is int and isinstance(v, bool))
        if not fits(value, kind) or (item_kind and not all(fits(v, item_kind) for v in value)):
            what = kind.__name__ + (f" of {item_kind.__name__}" if item_kind else "")
            raise TokenizerError(f"metadata key {key!r} must be a {what}, got {type(value).__name__}"
                                 f" {str(value)[:60]}")
        return value

    def _token_id(self, name: str) -> int | None:
        key = f"tokenizer.ggml.{name}_token_id"
        value = self.metadata.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value < len(self.tokens)):
            raise TokenizerError(f"{key} = {value} is outside the vocabulary ({len(self.tokens)} tokens)")
        return value

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    # --- building ------------------------------------------------------------------------------

    def _byte_level_bpe(self) -> Tokenizer:
        pre = self._optional("tokenizer.ggml.pre", "default", str)
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(f"tokenizer.ggml.pre {pre!r} is not supported "
                                 f"(supported: {sorted(PRE_TOKENIZERS)})")
        patterns, ignore_merges = PRE_TOKENIZERS[pre]
        merges = self._require(self.metadata, "tokenizer.ggml.merges", list, str)
        bad = next((m for m in merges if m.count(" ") != 1 or m.startswith(" ") or m.endswith(" ")), None)
        if bad is not None:
            raise TokenizerError(f"tokenizer.ggml.merges has {bad!r}, not two pieces separated by one space")
        merges = [tuple(m.split(" ")) for m in merges]
        vocab = {token: i for i, token in enumerate(self.tokens)}
        for left, right in merges:
            if left not in vocab or right not in vocab or left + right not in vocab:
                raise TokenizerError(f"tokenizer.ggml.merges has '{left} {right}', whose parts or "
                                     f"result are not in the vocabulary")
        tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer

    def _sentencepiece_bpe(self) -> Tokenizer:
        scores = self._require(self.metadata, "tokenizer.ggml.scores", list, (int, float))
        if len(scores) != len(self.tokens):
            raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for "
                                 f"{len(self.tokens)} tokens")
        vocab = {token: i for i, token in enumerate(self.tokens)}
        # Merges from scores: a piece that splits into two known pieces is a merge, ranked by
        # the piece's score (SentencePiece's BPE merges the best-scoring neighbour pair first).
        mergeable = [i for i, t in enumerate(self.token_types) if t in (NORMAL, USER_DEFINED)]
        ranked = []
        for i in mergeable:
            piece = self.tokens[i]
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    ranked.append((-scores[i], vocab[left], vocab[right], left, right))
        ranked.sort()
        unk = self._token_id("unknown")
        tokenizer = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in ranked], byte_fallback=True,
                                         unk_token=self.tokens[unk] if unk is not None else None))
        steps = [normalizers.Replace(" ", "▁")]
        space_prefix = self._optional("tokenizer.ggml.add_space_prefix", True, bool)
        if space_prefix:
            steps.insert(0, normalizers.Prepend("▁"))
        tokenizer.normalizer = normalizers.Sequence(steps)
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
        self.space_prefix = space_prefix
        return tokenizer

    def _end_of_generation_ids(self) -> list[int]:
        ids = {self.eos_token_id, self._token_id("eot")}
        ids |= {i for i in self.special_ids if self.tokens[i] in END_OF_GENERATION_TEXTS}
        return sorted(i for i in ids if i is not None)

    # --- use -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special_tokens: prepend BOS where the file says so.
        parse_special: read special-token texts (e.g. "<|eot|>") in `text` as those tokens;
        otherwise they are ordinary text."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        with self._lock:
            self._tokenizer.encode_special_tokens = not parse_special
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids if text else []
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self.tokens)]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary ({len(self.tokens)} tokens)")
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **variables):
        """Render the file's own `tokenizer.chat_template` (Jinja) with `messages`. tokenize:
        return token ids (special tokens in the rendering are parsed, no extra BOS)."""
        if not self.chat_template:
            raise ChatTemplateError("this model's GGUF has no tokenizer.chat_template; chat needs "
                                    "one (use a plain prompt instead)")
        text = render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self._text(self.bos_token_id),
                                    eos_token=self._text(self.eos_token_id), **variables)
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=False, parse_special=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a server's per-token logprobs carry them): a byte-level
        BPE token's characters mapped back to bytes; a SentencePiece token's "▁" as a space and a
        <0xXX> byte token as its byte; special and user-defined tokens as their text."""
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary ({len(self.tokens)} tokens)")
        text, kind = self.tokens[token_id], self.token_types[token_id]
        if token_id in self.special_ids:
            return text.encode("utf-8")
        if self.kind == "gpt2":
            return bytes(_BYTE_OF_CHAR.get(c, 0x3F) for c in text)  # '?' for a char outside the alphabet
        if kind == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:5], 16)])
        return text.replace("▁", " ").encode("utf-8")

    def _text(self, token_id) -> str:
        return "" if token_id is None else self.tokens[token_id]


def render_chat_template(template: str, messages, add_generation_prompt: bool, **variables) -> str:
    """Render with jinja2's immutable sandbox (templates come from downloaded files), with the
    helpers transformers gives templates: raise_exception and strftime_now."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    try:
        return env.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
    except TemplateError as error:
        raise ChatTemplateError(f"the file's chat template failed to render: {error}") from error


class StreamingDetokenizer:
    """Text of a growing list of ids, emitted as soon as it is whole: a token that ends in the
    middle of a UTF-8 character is held back until the character completes."""

    def __init__(self, tokenizer: GGUFTokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # ids before this are fully emitted
        self.read = 0  # text of ids[prefix:read] is emitted
        self.text = ""

    def add_token(self, token: int) -> str:
        """Append one id; return the new text it completes (possibly "")."""
        self.ids.append(int(token))
        emitted = self.tokenizer.decode(self.ids[self.prefix : self.read], self.skip)
        current = self.tokenizer.decode(self.ids[self.prefix :], self.skip)
        if len(current) > len(emitted) and not current.endswith("\ufffd"):
            delta = current[len(emitted) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def finalize(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        emitted = self.tokenizer.decode(self.ids[self.prefix : self.read], self.skip)
        current = self.tokenizer.decode(self.ids[self.prefix :], self.skip)
        delta = current[len(emitted) :]
        self.prefix = self.read = len(self.ids)
        self.text += delta
        return delta
