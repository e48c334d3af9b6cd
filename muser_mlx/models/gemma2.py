"""Gemma 2 (`gemma2`). What differs from a llama: the embedding is scaled by sqrt(hidden);
sandwich norms (the converter already added Gemma's +1 to every norm weight); GELU (tanh form)
in the FFN; halves-rotating RoPE (NEOX); even layers see a sliding window, odd ones everything,
unless the file lists its own pattern; attention scores and logits softcapped (s -> cap *
tanh(s / cap)); LM head tied to the embedding; the 27B's (46 layers') attention scale is
(hidden / heads)^-0.5, as llama.cpp sets it.

Every step caps the scores: the general step's attention (ops.attention), the fused GPU step's
attention_decode (SOFTCAP) and the CPU decode step's (DecodeHeads.softcap)."""

import math

from muser_mlx.models.config import Metadata, ModelConfig, common_config

ARCHITECTURE = "gemma2"
SWA_PERIOD = 2  # llama.cpp's value for Gemma 2: layer l uses the window when l % 2 == 0
DEFAULT_WINDOW = 4096
DEFAULT_ATTENTION_SOFTCAP, DEFAULT_FINAL_SOFTCAP = 50.0, 30.0  # llama.cpp's defaults
LAYERS_27B = 46


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    layers = meta.block_count(tensors)
    hidden, heads = meta.int("embedding_length"), meta.int("attention.head_count")
    rope_base = meta.float("rope.freq_base", default=10000.0, positive=True)
    overrides = dict(
        rope_traditional=False, rope_base=rope_base,
        rope_base_swa=meta.float("rope.freq_base_swa", default=rope_base, positive=True),
        sliding_window=meta.int("attention.sliding_window", default=DEFAULT_WINDOW),
        swa_layers=meta.sliding_window_layers(layers, default_period=SWA_PERIOD),
        sandwich_norms=True, activation="gelu_tanh", embed_scale=math.sqrt(hidden), tied_embeddings=True,
        softcap=meta.float("final_logit_softcapping", default=DEFAULT_FINAL_SOFTCAP, positive=True),
        attn_softcap=meta.float("attn_logit_softcapping", default=DEFAULT_ATTENTION_SOFTCAP, positive=True),
    )
    if layers == LAYERS_27B:
        overrides["attention_scale"] = (hidden / heads) ** -0.5
    return common_config(meta, tensors, **overrides)
