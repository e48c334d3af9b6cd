"""One module per architecture; each turns GGUF metadata into a `ModelConfig`, and
`transformer.Transformer` builds the graph from it."""

from __future__ import annotations

from muser_mlx.models import gemma2, gemma3, granite, llama, muse_glimmer, olmo2, phi3, qwen2, qwen3, smollm3
from muser_mlx.models.config import ModelConfig, ModelConfigError, UnsupportedArchitectureError
from muser_mlx.models.transformer import Transformer
from muser_mlx.settings import DEFAULT, Settings

ARCHITECTURES = {module.ARCHITECTURE: module for module in (muse_glimmer, llama, gemma3, qwen2, qwen3, smollm3, granite, phi3,
                                                            gemma2, olmo2)}

__all__ = ["ARCHITECTURES", "ModelConfig", "ModelConfigError", "Transformer", "config_for",
           "build_model", "graph_tensors"]


def config_for(metadata: dict, tensors: dict) -> ModelConfig:
    """The config of the model a GGUF file describes; refuses unknown architectures and
    contradictions between metadata and tensors, naming the key or tensor."""
    architecture = metadata.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"general.architecture is {architecture!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[architecture].config(metadata, tensors)


def graph_tensors(metadata: dict, tensors: dict) -> dict:
    """The tensors the graph reads by name: the file's, or views of them where the
    architecture fuses what the graph keeps apart (Phi-3's attn_qkv, gate|up)."""
    split = getattr(ARCHITECTURES.get(metadata.get("general.architecture")), "tensors", None)
    return split(metadata, tensors) if split else tensors


def build_model(gguf_file, settings: Settings = DEFAULT) -> Transformer:
    """The model graph over an open `GGUFFile`'s tensors (their bytes are read lazily), with
    `settings` fixed for it."""
    config = config_for(gguf_file.metadata, gguf_file.tensors)
    return Transformer(config, graph_tensors(gguf_file.metadata, gguf_file.tensors), settings)
