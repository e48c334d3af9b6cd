"""Qwen3 (`qwen3`). A Qwen2 without the q/k/v biases and with a per-head RMS norm of q and k
before RoPE (halves-rotating, llama.cpp's NEOX); RoPE scaled as llama.cpp reads
`rope.scaling.*` (YaRN for long contexts)."""

from muser_mlx.models.config import Metadata, ModelConfig, common_config, with_scaled_rope

ARCHITECTURE = "qwen3"


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    config = common_config(meta, tensors, rope_traditional=False, qk_norm=True,
                           rope_base=meta.float("rope.freq_base", default=1000000.0, positive=True))
    return with_scaled_rope(meta, tensors, config)
