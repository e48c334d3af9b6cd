"""Llama (`llama`: SmolLM2 and the Llama family). The plain decoder: rms norms before each
branch, SwiGLU, consecutive-pair RoPE on every layer (llama.cpp's converter permutes Q and K
rows for it), LM head tied to the embedding when the file has no `output.weight`."""

from muser_mlx.models.config import Metadata, ModelConfig, ModelConfigError, common_config

ARCHITECTURE = "llama"


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    scaling = metadata.get(meta.key("rope.scaling.type"), "none")
    if scaling != "none" or "rope_freqs.weight" in tensors:
        raise ModelConfigError(f"RoPE scaling ({meta.key('rope.scaling.type')} = {scaling!r} or a "
                               f"'rope_freqs.weight' tensor) is not supported")
    return common_config(meta, tensors)
