"""Llama (`llama`: SmolLM2 and the Llama family). The plain decoder: rms norms before each
branch, SwiGLU, consecutive-pair RoPE on every layer (llama.cpp's converter permutes Q and K
rows for it), LM head tied to the embedding when the file has no `output.weight` (Llama 3.2
1B and 3B). RoPE as llama.cpp scales it (`config.scaled_rope`): Llama 3.x's frequency factors
in `rope_freqs.weight`, `rope.scaling.type` linear or yarn."""

from muser_mlx.models.config import Metadata, ModelConfig, common_config, with_scaled_rope

ARCHITECTURE = "llama"


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    return with_scaled_rope(meta, tensors, common_config(meta, tensors))
