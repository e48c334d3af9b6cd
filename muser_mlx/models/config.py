"""One config for every decoder this package runs, read out of GGUF metadata.

`ModelConfig` lists what differs between architectures (rope style, norms, gates, window…);
each `models/<arch>.py` fills it from its own `<arch>.*` keys with `Metadata`. Every refusal
is a `ModelConfigError` subclass naming the key or tensor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np


class ModelConfigError(ValueError):
    """The file's metadata or tensors do not describe a model we can run."""


class MissingKeyError(ModelConfigError):
    pass


class MissingTensorError(ModelConfigError):
    pass


class TensorShapeError(ModelConfigError):
    pass


class UnsupportedArchitectureError(ModelConfigError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ff: int
    vocab: int  # rows of token_embd
    context: int
    eps: float
    rope_base: float
    rope_base_swa: float
    rotary_dim: int
    rope_traditional: bool  # rotate consecutive pairs (llama.cpp NORM) rather than halves (NEOX)
    rope_full_layers: bool  # False: full-attention layers use no rotation (NoPE)
    sliding_window: int | None
    swa_layers: tuple[bool, ...]  # per layer: sees only the last `sliding_window` positions
    attention_scale: float
    qk_norm: bool = False
    qk_norm_whole: bool = False  # the q/k norm over each whole projection (OLMo 2), not per head
    pre_norms: bool = True  # attn_norm / ffn_norm before each branch (False: it reads the stream itself)
    sandwich_norms: bool = False  # post_attention_norm / post_ffw_norm on each branch output
    post_norm_eps: float | None = None  # eps of the sandwich norms; None: `eps`
    attn_gate: bool = False  # o = attention ⊙ sigmoid(W_gate h) before W_o
    qkv_bias: bool = False
    embed_scale: float = 1.0
    embed_norm: bool = False  # weightless rms norm of the embedding row
    activation: str = "silu"  # of the gated FFN: "silu" or "gelu_tanh"
    tied_embeddings: bool = False
    logit_scale: float = 1.0
    softcap: float | None = None
    # The full-attention layers' RoPE inverse frequencies where they are not rope_base^(-2i /
    # rotary_dim): scaled (linear, YaRN) or divided by per-pair factors (Llama 3's rope_freqs,
    # Phi-3's rope_factors), as `scaled_rope` reads them. None: the plain ones.
    rope_freqs: tuple[float, ...] | None = None
    nope_layers: tuple[int, ...] = ()  # layers that rotate nothing (SmolLM3's every fourth)
    attn_softcap: float | None = None  # attention scores softcap * tanh(score / softcap) (Gemma 2)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the graph reads, with its GGUF shape ([in, out] for matrices)."""
        H, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {"token_embd.weight": (H, self.vocab), "output_norm.weight": (H,)}
        if not self.tied_embeddings:
            shapes["output.weight"] = (H, self.vocab)
        for i in range(self.layers):
            layer = {
                "attn_q.weight": (H, q), "attn_k.weight": (H, kv), "attn_v.weight": (H, kv),
                "attn_output.weight": (q, H), "ffn_gate.weight": (H, self.ff),
                "ffn_up.weight": (H, self.ff), "ffn_down.weight": (self.ff, H),
            }
            if self.pre_norms:
                layer.update({"attn_norm.weight": (H,), "ffn_norm.weight": (H,)})
            if self.qkv_bias:
                layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
            if self.qk_norm:
                layer.update({"attn_q_norm.weight": (q,) if self.qk_norm_whole else (self.head_dim,),
                              "attn_k_norm.weight": (kv,) if self.qk_norm_whole else (self.head_dim,)})
            if self.attn_gate:
                layer["attn_gate.weight"] = (H, q)
            if self.sandwich_norms:
                layer.update({"post_attention_norm.weight": (H,), "post_ffw_norm.weight": (H,)})
            shapes.update({f"blk.{i}.{name}": shape for name, shape in layer.items()})
        return shapes

    def check_tensors(self, tensors: dict) -> None:
        """Refuse a file whose tensors are missing or contradict this config, naming the tensor."""
        for name, expected in self.tensor_shapes().items():
            if name not in tensors:
                raise MissingTensorError(f"{self.architecture} model needs tensor {name!r}, "
                                         f"which the file does not have")
            actual = tuple(tensors[name].shape)
            if actual != expected:
                raise TensorShapeError(
                    f"tensor {name!r} has GGUF shape {list(actual)}, but the metadata implies "
                    f"{list(expected)} (hidden {self.hidden}, heads {self.heads}, kv heads "
                    f"{self.kv_heads}, head_dim {self.head_dim}, ff {self.ff}, vocab {self.vocab})"
                )

    @property
    def post_eps(self) -> float:
        """The eps of the sandwich post-norms (`post_norm_eps`, else `eps`)."""
        return self.eps if self.post_norm_eps is None else self.post_norm_eps

    def rope(self, layer: int) -> dict | None:
        """Layer `layer`'s rotation as the attention ops take it: dict(dims, traditional, base,
        freqs: the pairs' inverse frequencies or None for base^(-2i / dims)), or None where it
        rotates nothing (a full-attention layer of a NoPE model, a layer in nope_layers)."""
        sliding = self.swa_layers[layer]
        if not (sliding or self.rope_full_layers) or layer in self.nope_layers:
            return None
        return dict(dims=self.rotary_dim, traditional=self.rope_traditional,
                    base=self.rope_base_swa if sliding else self.rope_base,
                    freqs=None if sliding else self.rope_freqs)

    def check_context(self, end: int) -> None:
        """Refuse a step that would hold `end` positions, past the model's context."""
        if end > self.context:
            raise ValueError(f"{end} positions exceed the model's context of {self.context} tokens")

    @property
    def kv_bytes_per_token(self) -> int:
        """f32 keys + values one token adds to every full-attention layer."""
        return 2 * self.kv_heads * self.head_dim * 4


class Metadata:
    """Typed access to `<architecture>.*` keys, with errors that name the key."""

    def __init__(self, metadata: dict, architecture: str):
        self.metadata = metadata
        self.architecture = architecture

    def key(self, suffix: str) -> str:
        return f"{self.architecture}.{suffix}"

    def has(self, suffix: str) -> bool:
        return self.key(suffix) in self.metadata

    def int(self, suffix: str, default=None, minimum: int = 1) -> int:
        value = self._get(suffix, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise ModelConfigError(f"metadata key {self.key(suffix)!r} must be an integer >= "
                                   f"{minimum}, got {value!r}")
        return int(value)

    def float(self, suffix: str, default=None, positive: bool = False, non_negative: bool = False) -> float:
        """A finite number; positive: > 0 (a RoPE base, a scale, a softcap), non_negative: >= 0."""
        value = self._get(suffix, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                or not math.isfinite(value):
            raise ModelConfigError(f"metadata key {self.key(suffix)!r} must be a finite number, "
                                   f"got {value!r}")
        if (positive and value <= 0) or (non_negative and value < 0):
            raise ModelConfigError(f"metadata key {self.key(suffix)!r} must be a "
                                   f"{'positive' if positive else 'non-negative'} number, got {value!r}")
        return float(value)

    def block_count(self, tensors: dict, every_layer: str = "attn_norm.weight") -> int:
        """`block_count`, checked against the tensors before anything loops over layers (a
        hostile 2^40 must be an error, not an hour of work): the last layer has tensor
        `every_layer`, the one after it none."""
        layers = self.int("block_count")
        last, next_one = f"blk.{layers - 1}.{every_layer}", f"blk.{layers}.{every_layer}"
        if last not in tensors:
            raise MissingTensorError(f"{self.key('block_count')} = {layers}, but the file has no "
                                     f"tensor {last!r}")
        if next_one in tensors:
            raise ModelConfigError(f"{self.key('block_count')} = {layers}, but the file has "
                                   f"tensor {next_one!r} for a layer beyond it")
        return layers

    def _get(self, suffix: str, default):
        key = self.key(suffix)
        if key in self.metadata:
            return self.metadata[key]
        if default is None:
            raise MissingKeyError(f"metadata key {key!r} is required for a "
                                  f"{self.architecture} model and the file does not have it")
        return default

    def sliding_window_layers(self, layers: int, default_period: int | None = None) -> tuple[bool, ...]:
        """`attention.sliding_window_pattern`: a bool per layer, or a period P (layer l uses the
        window when l % P < P - 1). Without the key, `default_period` if the architecture has one."""
        key = self.key("attention.sliding_window_pattern")
        pattern = self.metadata.get(key, default_period)
        if pattern is None:
            raise MissingKeyError(f"metadata key {key!r} is required for a {self.architecture} "
                                  f"model (which layers use the sliding window) and is missing")
        if isinstance(pattern, (list, tuple)):
            if len(pattern) != layers or not all(isinstance(v, bool) for v in pattern):
                raise ModelConfigError(f"metadata key {key!r} lists {len(pattern)} values; it "
                                       f"needs one bool per layer ({layers} layers)")
            return tuple(pattern)
        if isinstance(pattern, bool) or not isinstance(pattern, (int, np.integer)) \
                or not 1 <= pattern <= layers:
            raise ModelConfigError(f"metadata key {key!r} must be a per-layer bool list or a "
                                   f"period between 1 and {layers}, got {pattern!r}")
        return tuple(layer % pattern < pattern - 1 for layer in range(layers))


def common_config(meta: Metadata, tensors: dict, every_layer: str = "attn_norm.weight",
                  **overrides) -> ModelConfig:
    """The keys every architecture shares; `overrides` states what the architecture changes;
    every_layer: a tensor each layer has (Metadata.block_count)."""
    layers = meta.block_count(tensors, every_layer)
    hidden = meta.int("embedding_length")
    heads = meta.int("attention.head_count")
    kv_heads = meta.int("attention.head_count_kv", default=heads)
    if heads % kv_heads:
        raise ModelConfigError(
            f"{meta.key('attention.head_count')} = {heads} is not a multiple of "
            f"{meta.key('attention.head_count_kv')} = {kv_heads}")
    default_head_dim = hidden // heads if hidden % heads == 0 else None
    head_dim = meta.int("attention.key_length", default=default_head_dim)
    value_dim = meta.int("attention.value_length", default=head_dim)
    if value_dim != head_dim:
        raise ModelConfigError(f"{meta.key('attention.value_length')} = {value_dim} differs from "
                               f"key_length {head_dim}; not supported")
    if "token_embd.weight" not in tensors:
        raise MissingTensorError("the file has no 'token_embd.weight' (the token embedding table)")
    embd_shape = tensors["token_embd.weight"].shape
    if len(embd_shape) != 2:
        raise TensorShapeError(f"tensor 'token_embd.weight' must be 2-D [hidden, vocab], "
                               f"has shape {list(embd_shape)}")
    vocab = embd_shape[1]
    rotary_dim = meta.int("rope.dimension_count", default=head_dim)
    if rotary_dim > head_dim or rotary_dim % 2:
        raise ModelConfigError(f"{meta.key('rope.dimension_count')} = {rotary_dim} must be even "
                               f"and at most the head dimension {head_dim}")
    rope_base = meta.float("rope.freq_base", default=10000.0, positive=True)
    values = dict(
        architecture=meta.architecture, layers=layers, hidden=hidden, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, ff=meta.int("feed_forward_length"), vocab=vocab,
        context=meta.int("context_length"), eps=meta.float("attention.layer_norm_rms_epsilon", non_negative=True),
        rope_base=rope_base, rope_base_swa=rope_base, rotary_dim=rotary_dim,
        rope_traditional=True, rope_full_layers=True, sliding_window=None,
        swa_layers=(False,) * layers, attention_scale=head_dim**-0.5,
        tied_embeddings="output.weight" not in tensors,
    )
    values.update(overrides)
    config = ModelConfig(**values)
    if config.sliding_window is None and any(config.swa_layers):
        raise MissingKeyError(f"metadata key {meta.key('attention.sliding_window')!r} is required: "
                              f"some layers use a sliding window")
    config.check_tensors(tensors)
    return config


# YaRN's correction range, llama.cpp's defaults (its llama-family models read no key for them).
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")  # longrope: Phi-3's factor tensors alone


@dataclass(frozen=True)
class ScaledRope:
    """What `scaled_rope` reads: the pairs' inverse frequencies (None: the plain ones) and
    `mscale`, which multiplies the rotated q and k (so their scores by mscale²)."""
    freqs: tuple[float, ...] | None
    mscale: float


def scaled_rope(meta: Metadata, tensors: dict, rotary_dim: int, base: float, context: int,
                factors: str = "rope_freqs.weight") -> ScaledRope:
    """RoPE as llama.cpp applies `rope.scaling.*` and a frequency-factor tensor: pair i turns by
    p * base^(-2i / rotary_dim) / factor[i] * s_i, where s_i is `1 / rope.scaling.factor`
    (linear; also llama.cpp's reading of a factor without a type), blended towards 1 over
    YaRN's ramp of pairs (yarn), or 1 (none); cos and sin times `mscale`
    (`rope.scaling.attn_factor`, and YaRN's 1 + 0.1 ln(factor)). factors: the tensor
    [rotary_dim / 2] that divides the frequencies where the file has it (Llama 3's
    `rope_freqs.weight`, Phi-3's long or short factors)."""
    key = meta.key("rope.scaling.type")
    scaling = meta.metadata.get(key, "linear")
    if scaling not in ROPE_SCALINGS:
        raise ModelConfigError(f"metadata key {key!r} is {scaling!r}; supported: {list(ROPE_SCALINGS)}")
    factor = meta.float("rope.scaling.factor" if meta.has("rope.scaling.factor") else "rope.scale_linear",
                        default=0.0, non_negative=True)  # the older key's name
    factor = 1.0 if factor == 0.0 or scaling == "none" else factor
    original = meta.int("rope.scaling.original_context_length", default=context)
    if scaling == "yarn" and base == 1.0:  # YaRN's ramp divides by ln(base)
        raise ModelConfigError(f"metadata key {meta.key('rope.freq_base')!r} is 1: YaRN needs another base")
    with np.errstate(all="ignore"):  # what overflows is refused below
        rope = _scaled_frequencies(meta, tensors, factors, scaling, factor, original, rotary_dim, base)
    if not (float32_finite(rope.freqs if rope.freqs is not None else 0.0, rope.mscale) and rope.mscale > 0):
        raise ModelConfigError(f"metadata keys {meta.key('rope.freq_base')!r} and {meta.key('rope.scaling')}.* "
                               f"make RoPE's frequencies or scale out of range")
    return rope


def float32_finite(*values) -> bool:
    """Whether every value is a finite float32 (the graph's numbers are)."""
    with np.errstate(all="ignore"):
        return all(bool(np.all(np.isfinite(np.asarray(v, dtype=np.float64).astype(np.float32)))) for v in values)


def _scaled_frequencies(meta, tensors, factors, scaling, factor, original, rotary_dim, base) -> ScaledRope:
    """scaled_rope's arithmetic on its inputs (read and checked there)."""
    from muser_mlx.formats import dequantize  # models import formats; config's dataclasses stay light

    half = rotary_dim // 2
    inverse = base ** (-2.0 * np.arange(half) / rotary_dim)
    if factors in tensors:
        t = tensors[factors]
        if tuple(t.shape) != (half,):
            raise TensorShapeError(f"tensor {factors!r} has GGUF shape {list(t.shape)}; RoPE's "
                                   f"{rotary_dim} rotated channels need [{half}]")
        divisors = dequantize(t.numpy(), t.ggml_type, t.shape).astype(np.float64).reshape(-1)
        if not np.all(np.isfinite(divisors) & (divisors > 0)):
            raise ModelConfigError(f"tensor {factors!r} must hold positive finite frequency factors")
        inverse = inverse / divisors
    mscale = meta.float("rope.scaling.attn_factor", default=1.0, positive=True)
    if scaling == "yarn":
        # llama.cpp's ggml_rope_yarn_corr_dims and rope_yarn_ramp: pairs below `low` keep their
        # own frequency (extrapolated), pairs above `high` are scaled (interpolated).
        def corr_dim(rotations):
            return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low = max(0.0, math.floor(corr_dim(YARN_BETA_FAST)))
        high = min(rotary_dim - 1.0, math.ceil(corr_dim(YARN_BETA_SLOW)))
        ramp = 1.0 - np.clip((np.arange(half) - low) / max(0.001, high - low), 0.0, 1.0)
        inverse = inverse * (ramp + (1.0 - ramp) / factor)
        if factor > 1.0:
            mscale *= 1.0 + 0.1 * math.log(factor)
    else:
        inverse = inverse / factor
    plain = factor == 1.0 and factors not in tensors
    return ScaledRope(None if plain else tuple(float(v) for v in inverse), mscale)


def with_scaled_rope(meta: Metadata, tensors: dict, config: ModelConfig, factors: str = "rope_freqs.weight") -> ModelConfig:
    """`config` with its full-attention layers' RoPE as `scaled_rope` reads it from the file,
    and RoPE's mscale folded into the attention scale (q and k each times mscale: scores times
    mscale²), which is exact only where RoPE rotates whole heads."""
    rope = scaled_rope(meta, tensors, config.rotary_dim, config.rope_base, config.context, factors)
    if rope.mscale != 1.0 and config.rotary_dim != config.head_dim:
        raise ModelConfigError(f"{meta.key('rope.scaling')}.*: a magnitude scale {rope.mscale:g} on "
                               f"{config.rotary_dim} of {config.head_dim} channels is not supported")
    with np.errstate(all="ignore"):
        scale = float(np.float64(config.attention_scale) * np.float64(rope.mscale) ** 2)
    if not float32_finite(scale) or scale <= 0:
        raise ModelConfigError(f"{meta.key('rope.scaling')}.*: a magnitude scale {rope.mscale:g} makes the "
                               f"attention scale {scale:g}")
    return dataclasses.replace(config, rope_freqs=rope.freqs, attention_scale=scale)


def unfused(tensors: dict, q_rows: int, kv_rows: int, ff: int) -> dict:
    """`tensors` with each layer's fused projections (Phi-3's) also as the separate ones the
    graph reads: `attn_qkv` [hidden, q + 2 kv] as attn_q, attn_k, attn_v, and a gate|up
    `ffn_up` [hidden, 2 ff] as ffn_gate (its first ff rows) and ffn_up (the rest), as llama.cpp
    splits their outputs. Each is a view of its rows' raw blocks in the file (a GGUF matrix is
    row-major), so nothing is copied or decoded; stacked again for one product, they are the
    fused tensor. A file without fused tensors comes back as it is."""
    from muser_mlx.gguf import GGUFTensor  # models/config stays free of file access otherwise

    def rows(tensor, name, first, count):
        row_bytes = tensor.nbytes // tensor.rows
        return GGUFTensor(name, tensor.ggml_type, (tensor.shape[0], count),
                          tensor.offset + first * row_bytes, count * row_bytes, tensor._file)

    out = dict(tensors)
    layer = 0
    while f"blk.{layer}.attn_output.weight" in tensors:
        prefix = f"blk.{layer}."
        qkv = tensors.get(prefix + "attn_qkv.weight")
        if qkv is not None:
            if tuple(qkv.shape[1:]) != (q_rows + 2 * kv_rows,):
                raise TensorShapeError(f"tensor '{prefix}attn_qkv.weight' has GGUF shape {list(qkv.shape)}; "
                                       f"q, k and v need {q_rows} + 2 x {kv_rows} rows")
            for name, first, count in (("q", 0, q_rows), ("k", q_rows, kv_rows), ("v", q_rows + kv_rows, kv_rows)):
                out[f"{prefix}attn_{name}.weight"] = rows(qkv, f"{prefix}attn_{name}.weight", first, count)
        up = tensors.get(prefix + "ffn_up.weight")
        if up is not None and prefix + "ffn_gate.weight" not in tensors:
            if tuple(up.shape[1:]) != (2 * ff,):
                raise TensorShapeError(f"tensor '{prefix}ffn_up.weight' has GGUF shape {list(up.shape)}; "
                                       f"a fused gate|up of feed_forward_length {ff} needs {2 * ff} rows")
            out[prefix + "ffn_gate.weight"] = rows(up, prefix + "ffn_gate.weight", 0, ff)
            out[prefix + "ffn_up.weight"] = rows(up, prefix + "ffn_up.weight", ff, ff)
        layer += 1
    return out
