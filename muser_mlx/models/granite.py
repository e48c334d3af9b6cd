"""Granite (`granite`, IBM Granite 3.x dense). A llama with four scales: the embedding times
`embedding_scale`, each branch times `residual_scale` before it joins the residual stream,
attention scores times `attention.scale`, logits divided by `logit_scale`.

The residual scale s needs no op of its own: the stream is carried divided by s (the
embedding times embedding_scale / s), so each branch joins it unscaled, and every norm that
reads the stream (attn_norm, ffn_norm, output_norm) takes eps / s², which makes rms(x / s)
exactly rms(x). No other norm reads the stream, so every step, kernel and cache is a llama's."""

import numpy as np

from muser_mlx.models.config import (Metadata, ModelConfig, ModelConfigError, common_config, float32_finite,
                                     with_scaled_rope)

ARCHITECTURE = "granite"


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    residual_scale = np.float64(meta.float("residual_scale", default=1.0, positive=True))
    with np.errstate(all="ignore"):  # a scale far from 1 may overflow float32: refused below, by name
        overrides = dict(
            embed_scale=np.float64(meta.float("embedding_scale", default=1.0, positive=True)) / residual_scale,
            eps=np.float64(meta.float("attention.layer_norm_rms_epsilon", non_negative=True)) / residual_scale**2,
            logit_scale=1.0 / np.float64(meta.float("logit_scale", positive=True)),
        )
    for name, value in overrides.items():
        if not float32_finite(value) or (name != "eps" and np.float32(value) == 0):  # the graph's numbers
            raise ModelConfigError(f"metadata keys {meta.key('residual_scale')!r}, {meta.key('embedding_scale')!r}, "
                                   f"{meta.key('logit_scale')!r} and the epsilon give {name} = {value}: out of range")
        overrides[name] = float(value)
    if meta.has("attention.scale"):
        overrides["attention_scale"] = meta.float("attention.scale", positive=True)
    return with_scaled_rope(meta, tensors, common_config(meta, tensors, **overrides))
