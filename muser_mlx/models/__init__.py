"""One module per architecture; each turns GGUF metadata into a `ModelConfig`, and
`transformer.Transformer` builds the graph from it."""

from __future__ import annotations

from muser_mlx.models import gemma3, granite, llama, muse_glimmer, qwen2, qwen3, smollm3
from muser_mlx.models.config import ModelConfig, ModelConfigError, UnsupportedArchitectureError
from muser_mlx.models.transformer import Transformer
from muser_mlx.settings import DEFAULT, Settings

ARCHITECTURES = {module.ARCHITECTURE: module for module in (muse_glimmer, llama, gemma3, qwen2, qwen3, smollm3, granite)}

__all__ = ["ARCHITECTURES", "ModelConfig", "ModelConfigError", "Transformer", "config_for",
           "build_model"]


def config_for(metadata: dict, tensors: dict) -> ModelConfig:
    """The config of the model a GGUF file describes; refuses unknown architectures and
    contradictions between metadata and tensors, naming the key or tensor."""
    architecture = metadata.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"general.architecture is {architecture!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[architecture].config(metadata, tensors)


def build_model(gguf_file, settings: Settings = DEFAULT) -> Transformer:
    """The model graph over an open `GGUFFile`'s tensors (their bytes are read lazily), with
    `settings` fixed for it."""
    config = config_for(gguf_file.metadata, gguf_file.tensors)
    return Transformer(config, gguf_file.tensors, settings)
