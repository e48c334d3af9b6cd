"""Helpers for building test data: a small GGUF writer and random valid blocks.

The writer is deliberately plain so tests can also build broken files from its pieces
(`gguf_bytes` returns the bytes; tests cut or patch them).
"""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx.formats import block_format, quantize, tensor_bytes
from muser_mlx.tokenizer import bytes_to_unicode

_INT_TYPES = {"u8": 0, "i8": 1, "u16": 2, "i16": 3, "u32": 4, "i32": 5, "u64": 10, "i64": 11}
_PACK = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value_type(value) -> int:
    if isinstance(value, bool):
        return 7
    if isinstance(value, int):
        return 5 if -(2**31) <= value < 2**31 else 11
    if isinstance(value, float):
        return 6
    if isinstance(value, str):
        return 8
    if isinstance(value, (list, tuple)):
        return 9
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


def _value(value, value_type: int) -> bytes:
    if value_type == 8:
        return _string(value)
    if value_type == 9:
        item_type = _value_type(value[0]) if len(value) else 5
        if item_type == 5 and any(not -(2**31) <= v < 2**31 for v in value):
            item_type = 11
        body = b"".join(_value(v, item_type) for v in value)
        return struct.pack("<IQ", item_type, len(value)) + body
    return struct.pack(_PACK[value_type], value)


def gguf_header(metadata: dict, infos, alignment: int = 32, version: int = 3) -> tuple[bytes, list[int]]:
    """The bytes before the tensor data, and each tensor's padded size. infos: a list of
    (name, ggml_type, GGUF shape, nbytes). A metadata value given as (type_name, value),
    e.g. ("u32", 7), fixes its integer type; a token id (a key ending in _token_id) is u32."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos), len(metadata))
    for key, value in metadata.items():
        if isinstance(value, tuple) and len(value) == 2 and value[0] in _INT_TYPES:
            value_type = _INT_TYPES[value[0]]
            value = value[1]
        elif key.endswith("_token_id") and isinstance(value, int):
            value_type = _INT_TYPES["u32"]  # as the GGUF spec has them: llama.cpp refuses an i32 one
        else:
            value_type = _value_type(value)
        head += _string(key) + struct.pack("<I", value_type) + _value(value, value_type)
    offset = 0
    padded_sizes = []
    for name, ggml_type, shape, nbytes in infos:
        head += _string(name) + struct.pack("<I", len(shape))
        head += struct.pack(f"<{len(shape)}Q", *shape)
        head += struct.pack("<IQ", int(ggml_type), offset)
        padded_sizes.append(-(-nbytes // alignment) * alignment)
        offset += padded_sizes[-1]
    head += bytes(-len(head) % alignment)
    return head, padded_sizes


def gguf_bytes(
    metadata: dict,
    tensors: dict[str, tuple[GGMLType, tuple[int, ...], np.ndarray]],
    alignment: int = 32,
    version: int = 3,
) -> bytes:
    """A GGUF file as bytes. tensors: name -> (ggml_type, GGUF shape, raw uint8 bytes)."""
    raws = {name: np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
            for name, (_, _, raw) in tensors.items()}
    infos = [(name, t, shape, raws[name].size) for name, (t, shape, _) in tensors.items()]
    head, padded = gguf_header(metadata, infos, alignment, version)
    blobs = [raws[name].tobytes() + bytes(size - raws[name].size) for (name, *_), size in zip(infos, padded)]
    return head + b"".join(blobs)


def write_gguf(path, metadata: dict, tensors: dict, alignment: int = 32) -> Path:
    path = Path(path)
    path.write_bytes(gguf_bytes(metadata, tensors, alignment))
    return path


def write_gguf_streaming(path, metadata: dict, infos, fill, alignment: int = 32) -> Path:
    """Write a GGUF too large to build in memory: infos as for gguf_header; fill(name,
    ggml_type, nbytes) returns each tensor's bytes (a uint8 array) when its turn comes."""
    path = Path(path)
    head, padded = gguf_header(metadata, infos, alignment)
    with open(path, "wb") as out:
        out.write(head)
        for (name, ggml_type, _, nbytes), size in zip(infos, padded):
            raw = fill(name, ggml_type, nbytes)
            if raw.size != nbytes:
                raise ValueError(f"fill gave {raw.size} bytes for {name!r}, which needs {nbytes}")
            out.write(memoryview(np.ascontiguousarray(raw)))
            out.write(bytes(size - nbytes))
    return path


def random_blocks(rng: np.random.Generator, ggml_type, rows: int, row_length: int) -> np.ndarray:
    """Valid raw bytes for a [row_length, rows] tensor: realistic values quantized the way
    llama.cpp would, or (for formats with no quantizer) random bytes with finite f16 scales.
    Values are drawn fresh from `rng`; never all zeros."""
    fmt = block_format(ggml_type)
    values = rng.standard_normal((rows, row_length)).astype(np.float32)
    values *= rng.uniform(0.01, 2.0, size=(rows, 1)).astype(np.float32)
    try:
        return quantize(values, fmt.ggml_type)
    except ValueError:
        pass
    raw = rng.integers(0, 256, size=tensor_bytes(fmt.ggml_type, (row_length, rows)), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.type_size)
    for start in _F16_FIELDS[fmt.ggml_type]:
        scale = rng.uniform(0.001, 0.1, size=blocks.shape[0]).astype(np.float16)
        blocks[:, start : start + 2] = scale.reshape(-1, 1).view(np.uint8)
    return raw.reshape(rows, -1)


# Byte offsets of the f16 scale fields of formats with no quantizer here.
_F16_FIELDS = {
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
}


# ---------------------------------------------------------------------------------------------
# Tiny models: every architecture, any weight format, a small real tokenizer
# ---------------------------------------------------------------------------------------------

# Weight formats per tensor of a "Q4_K_M"-like mix, as llama.cpp's Q4_K_M picks them: most
# matrices Q4_K, attn_v / ffn_down / the LM head one step up (Q6_K).
Q4_K_M_MIX = {"attn_v": GGMLType.Q6_K, "ffn_down": GGMLType.Q6_K, "output": GGMLType.Q6_K,
              "token_embd": GGMLType.Q4_K}

CORPUS = (
    "the quick brown fox jumps over the lazy dog. the capital of france is paris. "
    "in the beginning there was the word, and the word was with the model. "
    "def main():\n    return 42\n"
)


def _learn_merges(words: list[list[str]], count: int) -> list[tuple[str, str]]:
    """Plain BPE training: repeatedly merge the most frequent adjacent pair (ties: first seen)."""
    merges = []
    for _ in range(count):
        pairs: dict[tuple[str, str], int] = {}
        for word in words:
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + 1
        if not pairs:
            break
        best = max(pairs, key=pairs.get)
        merges.append(best)
        for i, word in enumerate(words):
            merged, j = [], 0
            while j < len(word):
                if j + 1 < len(word) and (word[j], word[j + 1]) == best:
                    merged.append(word[j] + word[j + 1])
                    j += 2
                else:
                    merged.append(word[j])
                    j += 1
            words[i] = merged
    return merges


MUSE_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start|>", "<|message|>", "<|eom|>", "<|eot|>"]
MUSE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
    "<|eot|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def bpe_tokenizer_metadata(merges: int = 64, pre: str = "llama4") -> dict:
    """tokenizer.ggml.* keys of a small byte-level BPE vocabulary (model gpt2): the 256 byte
    symbols, merges learnt from CORPUS, then Muse Glimmer's special tokens."""
    byte_chars = bytes_to_unicode()
    words = [[byte_chars[b] for b in word.encode()] for word in CORPUS.replace(" ", " \0").split("\0")]
    learnt = _learn_merges(words, merges)
    tokens = [byte_chars[b] for b in range(256)] + ["".join(pair) for pair in learnt]
    tokens = list(dict.fromkeys(tokens))
    types = [1] * len(tokens) + [3] * len(MUSE_SPECIALS)
    tokens += MUSE_SPECIALS
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in learnt],
        "tokenizer.ggml.bos_token_id": tokens.index("<|begin_of_text|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|end_of_text|>"),
        "tokenizer.ggml.eot_token_id": tokens.index("<|eot|>"),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": MUSE_CHAT_TEMPLATE,
    }


def spm_tokenizer_metadata(pieces: int = 64) -> dict:
    """tokenizer.ggml.* keys of a small SentencePiece vocabulary (model llama, as Gemma 3):
    control tokens, 256 byte-fallback tokens, then pieces of CORPUS scored by frequency."""
    controls = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    words = [list(word) for word in CORPUS.replace(" ", " \0").split("\0")]
    words = [[("▁" if ch == " " else ch) for ch in word] for word in words]
    learnt = _learn_merges(words, pieces)
    chars = sorted({ch for word in CORPUS for ch in word.replace(" ", "▁")})
    merged = ["".join(pair) for pair in learnt]
    vocab = list(dict.fromkeys(chars + merged))
    tokens = controls + byte_tokens + [p for p in vocab if p not in controls]
    # Later merges score lower, as SentencePiece's BPE scores do; single characters lowest.
    scores = [0.0] * len(controls) + [0.0] * 256
    scores += [(-1000.0 - i if p in chars else -float(merged.index(p))) for i, p in
               enumerate(tokens[len(controls) + 256 :])]
    types = [3] * len(controls) + [6] * 256 + [1] * (len(tokens) - len(controls) - 256)
    types[3] = 2  # <unk>
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }


def _weight_type(name: str, weights) -> GGMLType:
    if weights == "Q4_K_M":
        for part, ggml_type in Q4_K_M_MIX.items():
            if name.startswith(part) or f".{part}." in name:
                return ggml_type
        return GGMLType.Q4_K
    return block_format(weights).ggml_type


# What each architecture's tiny model holds beyond a llama's tensors and keys, as llama.cpp's
# converter names them: "window" sliding-window layers (a period or a list of bools),
# "qk_norm" per-head q/k norms ("qk_norm_full": over the whole projection, OLMo 2),
# "sandwich" post-branch norms ("post_only": and no pre-branch norms), "gate" the attention
# gate, "bias" q/k/v biases, "output" an untied LM head, "fused" one attn_qkv and a gate|up
# ffn_up (Phi-3), "spm" a SentencePiece vocabulary, "pre" the BPE pre-tokenizer.
TINY_ARCHITECTURES = {
    "muse-glimmer": dict(window=4, qk_norm=True, sandwich=True, gate=True, output=True, pre="llama4"),
    "llama": dict(pre="smollm"),
    "gemma3": dict(window=4, qk_norm=True, sandwich=True, spm=True),
    "qwen2": dict(bias=True, output=True, pre="qwen2"),
    "qwen3": dict(qk_norm=True, output=True, pre="qwen2"),
    "smollm3": dict(pre="smollm"),
    "granite": dict(output=True, pre="smollm"),
    "phi3": dict(fused=True, output=True, pre="smollm"),
    "gemma2": dict(window=2, sandwich=True, spm=True),
    "olmo2": dict(qk_norm_full=True, sandwich=True, post_only=True, output=True, pre="smollm"),
}
# Keys an architecture's tiny model sets beyond the shared ones (llama.cpp's names).
TINY_METADATA = {
    "muse-glimmer": {"logit_scale": float(1 / np.sqrt(26)), "final_logit_softcapping": 20.0},
    "granite": {"logit_scale": 2.5, "residual_scale": 0.22, "embedding_scale": 12.0,
                "attention.scale": 0.0078125},
    "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
}


def tiny_model(path, architecture: str, rng: np.random.Generator, weights="F32", layers: int = 4,
               hidden: int = 256, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
               ff: int = 512, window: int = 8, pattern="list", context: int = 512,
               extra_metadata: dict | None = None, drop: tuple[str, ...] = (),
               extra_tensors: dict | None = None) -> Path:
    """Write a small random model of `architecture` whose weights are valid `weights` blocks
    (a format name, or "Q4_K_M" for a mix). pattern: "list" (a bool per layer) or "period"
    (a scalar) for the sliding-window layers. `drop` leaves out metadata keys or tensors;
    `extra_tensors` adds float32 ones (name -> values, e.g. Llama 3's "rope_freqs.weight")."""
    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"no tiny model for architecture {architecture!r}; known: {sorted(TINY_ARCHITECTURES)}")
    arch = architecture
    kind = TINY_ARCHITECTURES[arch]
    tokenizer = spm_tokenizer_metadata() if kind.get("spm") else bpe_tokenizer_metadata(pre=kind["pre"])
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    metadata = {
        "general.architecture": arch,
        f"{arch}.block_count": ("u32", layers),
        f"{arch}.context_length": ("u32", context),
        f"{arch}.embedding_length": ("u32", hidden),
        f"{arch}.feed_forward_length": ("u32", ff),
        f"{arch}.attention.head_count": ("u32", heads),
        f"{arch}.attention.head_count_kv": ("u32", kv_heads),
        f"{arch}.attention.key_length": ("u32", head_dim),
        f"{arch}.attention.value_length": ("u32", head_dim),
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
    }
    if "window" in kind:
        period = kind["window"]
        metadata[f"{arch}.attention.sliding_window"] = ("u32", window)
        metadata[f"{arch}.attention.sliding_window_pattern"] = (
            [layer % period < period - 1 for layer in range(layers)] if pattern == "list"
            else ("u32", period))
    metadata.update({f"{arch}.{key}": value for key, value in TINY_METADATA.get(arch, {}).items()})
    # Token ids as llama.cpp's converter stores them (u32: llama.cpp refuses an i32).
    metadata.update({key: ("u32", value) if key.endswith("_token_id") else value
                     for key, value in tokenizer.items()})
    metadata.update(extra_metadata or {})

    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"token_embd.weight": (hidden, vocab), "output_norm.weight": (hidden,)}
    if kind.get("output"):
        shapes["output.weight"] = (hidden, vocab)
    for i in range(layers):
        layer = {"attn_norm.weight": (hidden,), "attn_q.weight": (hidden, q),
                 "attn_k.weight": (hidden, kv), "attn_v.weight": (hidden, kv),
                 "attn_output.weight": (q, hidden), "ffn_norm.weight": (hidden,),
                 "ffn_gate.weight": (hidden, ff), "ffn_up.weight": (hidden, ff),
                 "ffn_down.weight": (ff, hidden)}
        if kind.get("fused"):
            del layer["attn_q.weight"], layer["attn_k.weight"], layer["attn_v.weight"], layer["ffn_gate.weight"]
            layer = {"attn_qkv.weight": (hidden, q + 2 * kv), **layer, "ffn_up.weight": (hidden, 2 * ff)}
        if kind.get("post_only"):
            del layer["attn_norm.weight"], layer["ffn_norm.weight"]
        if kind.get("qk_norm"):
            layer.update({"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)})
        if kind.get("qk_norm_full"):
            layer.update({"attn_q_norm.weight": (q,), "attn_k_norm.weight": (kv,)})
        if kind.get("sandwich"):
            layer.update({"post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,)})
        if kind.get("gate"):
            layer["attn_gate.weight"] = (hidden, q)
        if kind.get("bias"):
            layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        shapes.update({f"blk.{i}.{name}": shape for name, shape in layer.items()})

    tensors = {}
    for name, shape in shapes.items():
        if name in drop:
            continue
        if len(shape) == 1:
            if name.endswith(".bias"):
                values = 0.1 * rng.standard_normal(shape)
            else:
                values = rng.uniform(0.5, 1.5, size=shape)
            tensors[name] = (GGMLType.F32, shape, values.astype(np.float32).view(np.uint8))
            continue
        ggml_type = _weight_type(name, weights)
        fan_in, rows = shape
        values = rng.standard_normal((rows, fan_in)).astype(np.float32) / np.sqrt(fan_in)
        if name == "token_embd.weight":
            values *= np.sqrt(fan_in)  # embedding rows of unit scale, as trained tables are
        tensors[name] = (ggml_type, shape, quantize(values, ggml_type))
    for name, values in (extra_tensors or {}).items():
        values = np.ascontiguousarray(values, dtype=np.float32)
        tensors[name] = (GGMLType.F32, values.shape[::-1], values.view(np.uint8))
    metadata = {k: v for k, v in metadata.items() if k not in drop}
    return write_gguf(path, metadata, tensors)


# The tiny models llama.cpp's logits were recorded for (tests/data/record_llama_cpp_logits.py,
# tests/test_llama_cpp_logits.py): name -> (architecture, seed, tiny_model keywords, extra
# float32 tensors as functions of a generator seeded seed + 1). Changing a case changes its
# file: re-record.
LLAMA_CPP_PROMPT, LLAMA_CPP_STEPS = 16, 16


def _llama3_factors(rng):
    """Llama 3.1's shape of rope_freqs: 1 for the fast pairs, 8 for the slow, a ramp between."""
    ramp = np.clip((np.arange(32) - 8) / 16, 0.0, 1.0)
    return 1.0 + 7.0 * ramp + rng.uniform(0.0, 0.1, 32)


LLAMA_CPP_CASES = {
    "llama3": ("llama", 1, {}, {"rope_freqs.weight": _llama3_factors}),
    "llama-linear": ("llama", 2, {"extra_metadata": {"llama.rope.scaling.type": "linear",
                                                     "llama.rope.scaling.factor": 2.0}}, {}),
    "llama-yarn": ("llama", 3, {"extra_metadata": {"llama.rope.scaling.type": "yarn",
                                                   "llama.rope.scaling.factor": 4.0,
                                                   "llama.rope.scaling.original_context_length": ("u32", 64)}}, {}),
    "qwen3": ("qwen3", 4, {}, {}),
    "smollm3": ("smollm3", 5, {}, {}),
    "granite": ("granite", 6, {}, {}),
    "phi3": ("phi3", 7, {"extra_metadata": {"phi3.rope.scaling.type": "longrope",
                                            "phi3.rope.scaling.attn_factor": 1.19,
                                            "phi3.rope.scaling.original_context_length": ("u32", 128)}},
             {"rope_factors_long.weight": lambda rng: rng.uniform(1.0, 6.0, 32),
              "rope_factors_short.weight": lambda rng: rng.uniform(1.0, 1.5, 32)}),
    # Caps small enough to bite these scores and logits (Gemma 2's own are 50 and 30).
    "gemma2": ("gemma2", 8, {"window": 8, "extra_metadata": {"gemma2.attn_logit_softcapping": 1.0,
                                                            "gemma2.final_logit_softcapping": 8.0}}, {}),
    "olmo2": ("olmo2", 9, {}, {}),
}


def llama_cpp_case(path, name: str, weights="F32") -> Path:
    """Write case `name` of LLAMA_CPP_CASES (its weights as `weights`: F32 is the recorded one)."""
    architecture, seed, keywords, extra = LLAMA_CPP_CASES[name]
    extra_rng = np.random.default_rng(seed + 1)
    tensors = {tensor: make(extra_rng) for tensor, make in extra.items()}
    return tiny_model(path, architecture, np.random.default_rng(seed), weights=weights,
                      extra_tensors=tensors, **keywords)


@contextlib.contextmanager
def recorded_launches(backend: str = "cuda"):
    """Inside this block the ops take their `backend` (GPU) path on any machine, and every
    kernel launch is recorded as (name, inputs, template dict, grid, threadgroup,
    output_shapes) and answered with zeros instead of run: the host half of a GPU step, for
    checking launches and timing graph building without a GPU."""
    import mlx.core as mx  # testing stays importable without touching MLX's devices

    from muser_mlx import kernels

    launches = []

    def record(name, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        launches.append((name, inputs, dict(template), grid, threadgroup, output_shapes))
        return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]

    saved = kernels.backend, kernels.launch
    kernels.backend, kernels.launch = (lambda: backend), record
    try:
        yield launches
    finally:
        kernels.backend, kernels.launch = saved
