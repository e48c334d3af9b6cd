"""Phi-3 (`phi3`: Phi-3 and Phi-3.5 mini, Phi-4 mini). A llama whose q, k and v are one fused
`attn_qkv` and whose gate and up are one `ffn_up` (gate rows first), read as separate row views
of those tensors (`config.unfused`); halves-rotating RoPE (NEOX); `rope_factors_long` /
`rope_factors_short` divide its frequencies, the long ones where the model's context exceeds
`rope.scaling.original_context_length` (llama.cpp's choice for a context of that size), and
`rope.scaling.attn_factor` scales the rotated q and k. llama.cpp turns Phi-3's sliding window
off; so does this."""

from muser_mlx.models.config import Metadata, ModelConfig, common_config, unfused, with_scaled_rope

ARCHITECTURE = "phi3"


def tensors(metadata: dict, file_tensors: dict) -> dict:
    """The tensors the graph reads: the fused projections as separate views."""
    meta = Metadata(metadata, ARCHITECTURE)
    hidden, heads = meta.int("embedding_length"), meta.int("attention.head_count")
    head_dim = meta.int("attention.key_length", default=hidden // heads)
    kv_heads = meta.int("attention.head_count_kv", default=heads)
    return unfused(file_tensors, heads * head_dim, kv_heads * head_dim, meta.int("feed_forward_length"))


def config(metadata: dict, file_tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    split = tensors(metadata, file_tensors)
    context = meta.int("context_length")
    original = meta.int("rope.scaling.original_context_length", default=context)
    factors = "rope_factors_long.weight" if context > original else "rope_factors_short.weight"
    return with_scaled_rope(meta, split, common_config(meta, split, rope_traditional=False), factors)
