"""Gemma 3 (`gemma3`). What differs from a llama: the embedding is scaled by sqrt(hidden);
sandwich norms (llama.cpp's converter already added Gemma's +1 to every norm weight); per-head
QK norm; GELU (tanh form) in the FFN; NEOX-style RoPE with base 10000 on sliding-window layers
and `rope.freq_base` on the global ones; five sliding-window layers, then one global, unless
the file lists its own pattern; LM head tied to the embedding."""

import math

from muser_mlx.models.config import Metadata, ModelConfig, common_config

ARCHITECTURE = "gemma3"
SWA_PERIOD = 6  # llama.cpp's value for Gemma 3: layer l is global when l % 6 == 5
SWA_ROPE_BASE = 10000.0


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    layers = meta.block_count(tensors)
    hidden = meta.int("embedding_length")
    return common_config(
        meta, tensors,
        rope_traditional=False,
        rope_base=meta.float("rope.freq_base", default=1000000.0, positive=True),
        rope_base_swa=SWA_ROPE_BASE,
        sliding_window=meta.int("attention.sliding_window"),
        swa_layers=meta.sliding_window_layers(layers, default_period=SWA_PERIOD),
        qk_norm=True, sandwich_norms=True, activation="gelu_tanh", embed_scale=math.sqrt(hidden),
    )
