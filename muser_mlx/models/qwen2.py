"""Qwen2 (`qwen2`). A llama with biases on the Q, K and V projections and RoPE that rotates
the two halves of each head (llama.cpp's NEOX style)."""

from muser_mlx.models.config import Metadata, ModelConfig, common_config

ARCHITECTURE = "qwen2"


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    return common_config(meta, tensors, rope_traditional=False, qkv_bias=True,
                         rope_base=meta.float("rope.freq_base", default=1000000.0, positive=True))
