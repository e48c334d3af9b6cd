"""The numpy reference forward pass: float64, one whole sequence at a time, written to be read.

It computes what ../shared/MUSE_GLIMMER.md (and the llama / gemma3 / qwen2 variants of the
same decoder) says, from the GGUF's weights decoded by `formats.dequantize`. Slow and obviously
correct: tests judge the MLX graph and every kernel against it.
"""

from __future__ import annotations

import numpy as np

from muser_mlx.formats import (GGMLType, dequantize, dequantize_activations, quantize_activations,
                               quantize_activations_super)
from muser_mlx.models.config import ModelConfig, unfused


K_QUANTS = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)


def rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x: np.ndarray, positions: np.ndarray, rotary_dim: int, base: float, consecutive: bool,
         freqs=None):
    """Rotate the first rotary_dim channels of x [T, heads, head_dim] by angle p·base^(-2i/rotary)
    (or p·freqs[i] where the model gives its pairs' inverse frequencies: scaled or factored RoPE).
    consecutive: channels (2i, 2i+1) form pair i; otherwise (i, i + rotary/2) do."""
    half = rotary_dim // 2
    inverse = base ** (-2.0 * np.arange(half) / rotary_dim) if freqs is None else np.asarray(freqs, np.float64)
    angles = positions[:, None] * inverse  # [T, half]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    out = x.copy()
    if consecutive:
        first, second = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = first * cos - second * sin
        out[..., 1:rotary_dim:2] = first * sin + second * cos
    else:
        first, second = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = first * cos - second * sin
        out[..., half:rotary_dim] = first * sin + second * cos
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class Reference:
    """Decoded float64 weights of one model. weights(name) -> [out, in] (matrices) or [n].

    decode_numerics: compute what the fused GPU decode step does on purpose, rather than the
    exact function: every product's input rounded to q8x (formats.quantize_activations) and
    keys and values rounded to float16 as the cache stores them. The rest stays float64.
    float16_cache=False: keys and values kept as computed, as the CPU decode step's float32
    cache keeps them (models/cpu_decode.py).
    q8_k: products of K-quant weights (Q4_K, Q5_K, Q6_K) read x rounded per 256 values instead
    (formats.quantize_activations_super), as the CPU decode step's do."""

    def __init__(self, config: ModelConfig, tensors: dict, decode_numerics: bool = False,
                 float16_cache: bool = True, q8_k: bool = False):
        self.config = config
        # Fused projections (Phi-3's attn_qkv, gate|up) read as the separate ones they hold.
        self.tensors = unfused(tensors, config.heads * config.head_dim, config.kv_heads * config.head_dim, config.ff)
        self.decode_numerics = decode_numerics
        self.float16_cache = float16_cache
        self.q8_k = q8_k
        self._cache = {}

    def product(self, x: np.ndarray, name: str) -> np.ndarray:
        """x [T, n] @ W.T for the matrix `name`, x as that product reads it."""
        return self.product_input(x, self.tensors[name].ggml_type) @ self.weight(name).T

    def product_input(self, x: np.ndarray, ggml_type) -> np.ndarray:
        """x [T, n] as a product of `ggml_type` weights reads it."""
        if not self.decode_numerics:
            return x
        if self.q8_k and ggml_type in K_QUANTS:
            codes, scales = quantize_activations_super(x.astype(np.float32))
        else:
            codes, scales, _ = quantize_activations(x.astype(np.float32))
        return dequantize_activations(codes, scales).astype(np.float64)

    def cached(self, x: np.ndarray) -> np.ndarray:
        """Keys or values as the cache holds them."""
        return x.astype(np.float16).astype(np.float64) if self.decode_numerics and self.float16_cache else x

    def weight(self, name: str) -> np.ndarray:
        if name not in self._cache:
            t = self.tensors[name]
            values = dequantize(t.numpy(), t.ggml_type, t.shape).astype(np.float64)
            self._cache[name] = values.reshape(-1) if len(t.shape) == 1 else values
        return self._cache[name]

    def forward(self, token_ids) -> np.ndarray:
        """token_ids: [T] ints, positions 0 … T-1. Returns float64 logits [T, vocab]."""
        c = self.config
        ids = np.asarray(token_ids)
        positions = np.arange(ids.size, dtype=np.float64)
        x = self.weight("token_embd.weight")[ids]  # [T, hidden]
        if c.embed_norm:
            x = rms(x, c.eps)
        x = x * c.embed_scale
        for layer in range(c.layers):
            x = self.block(layer, x, positions)
        head = "token_embd.weight" if c.tied_embeddings else "output.weight"
        logits = self.product(rms(x, c.eps) * self.weight("output_norm.weight"), head) * c.logit_scale
        if c.softcap is not None:
            logits = c.softcap * np.tanh(logits / c.softcap)
        return logits

    def block(self, layer: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        c = self.config
        w = lambda name: self.weight(f"blk.{layer}.{name}")  # noqa: E731
        product = lambda x, name: self.product(x, f"blk.{layer}.{name}.weight")  # noqa: E731
        post_eps = c.eps if c.post_norm_eps is None else c.post_norm_eps
        pre_norm = lambda x, name: rms(x, c.eps) * w(name) if c.pre_norms else x  # noqa: E731
        a = self.attention(layer, pre_norm(x, "attn_norm.weight"), positions)
        if c.sandwich_norms:
            a = rms(a, post_eps) * w("post_attention_norm.weight")
        x = x + a
        h = pre_norm(x, "ffn_norm.weight")
        act = silu if c.activation == "silu" else gelu_tanh
        f = product(act(product(h, "ffn_gate")) * product(h, "ffn_up"), "ffn_down")
        if c.sandwich_norms:
            f = rms(f, post_eps) * w("post_ffw_norm.weight")
        return x + f

    def attention(self, layer: int, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """h: [T, hidden] -> [T, hidden]; a loop over query heads, the mask spelled out."""
        c = self.config
        w = lambda name: self.weight(f"blk.{layer}.{name}")  # noqa: E731
        product = lambda x, name: self.product(x, f"blk.{layer}.{name}.weight")  # noqa: E731
        T = h.shape[0]
        q, k, v = product(h, "attn_q"), product(h, "attn_k"), product(h, "attn_v")
        if c.qkv_bias:
            q, k, v = q + w("attn_q.bias"), k + w("attn_k.bias"), v + w("attn_v.bias")
        if c.qk_norm_whole:  # over each whole projection, before the head split
            q, k = rms(q, c.eps) * w("attn_q_norm.weight"), rms(k, c.eps) * w("attn_k_norm.weight")
        q = q.reshape(T, c.heads, c.head_dim)
        k = k.reshape(T, c.kv_heads, c.head_dim)
        v = v.reshape(T, c.kv_heads, c.head_dim)
        if c.qk_norm and not c.qk_norm_whole:
            q = rms(q, c.eps) * w("attn_q_norm.weight")
            k = rms(k, c.eps) * w("attn_k_norm.weight")
        sliding = c.swa_layers[layer]
        turn = c.rope(layer)
        if turn is not None:
            q = rope(q, positions, turn["dims"], turn["base"], turn["traditional"], turn["freqs"])
            k = rope(k, positions, turn["dims"], turn["base"], turn["traditional"], turn["freqs"])
        k, v = self.cached(k), self.cached(v)
        query_pos, key_pos = positions[:, None], positions[None, :]
        visible = key_pos <= query_pos
        if sliding:
            visible &= key_pos > query_pos - c.sliding_window
        group = c.heads // c.kv_heads
        out = np.empty((T, c.heads, c.head_dim))
        for head in range(c.heads):
            kv = head // group
            scores = q[:, head] @ k[:, kv].T * c.attention_scale  # [T, T]
            if c.attn_softcap is not None:
                scores = c.attn_softcap * np.tanh(scores / c.attn_softcap)
            scores = np.where(visible, scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            out[:, head] = probs @ v[:, kv]
        o = out.reshape(T, c.heads * c.head_dim)
        if c.attn_gate:
            o = o / (1.0 + np.exp(-product(h, "attn_gate")))
        return product(o, "attn_output")
