"""SmolLM3 (`smollm3`). A llama whose every fourth layer (3, 7, 11, ...) rotates nothing
(NoPE), as llama.cpp's n_no_rope_layer_step = 4; RoPE scaled as llama.cpp reads
`rope.scaling.*`."""

from muser_mlx.models.config import Metadata, ModelConfig, common_config, with_scaled_rope

ARCHITECTURE = "smollm3"
NO_ROPE_STEP = 4  # llama.cpp's value for SmolLM3: layer l has no RoPE when (l + 1) % 4 == 0


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    layers = meta.block_count(tensors)
    nope = tuple(layer for layer in range(layers) if (layer + 1) % NO_ROPE_STEP == 0)
    return with_scaled_rope(meta, tensors, common_config(meta, tensors, nope_layers=nope))
