"""Granite (`granite`, IBM Granite 3.x dense). A llama with four scales: the embedding times
`embedding_scale`, each branch times `residual_scale` before it joins the residual stream,
attention scores times `attention.scale`, logits divided by `logit_scale`.

The residual scale s needs no op of its own: the stream is carried divided by s (the
embedding times embedding_scale / s), so each branch joins it unscaled, and every norm that
reads the stream (attn_norm, ffn_norm, output_norm) takes eps / s², which makes rms(x / s)
exactly rms(x). No other norm reads the stream, so every step, kernel and cache is a llama's."""

from muser_mlx.models.config import Metadata, ModelConfig, ModelConfigError, common_config, with_scaled_rope

ARCHITECTURE = "granite"


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    residual_scale = meta.float("residual_scale", default=1.0, positive=True)
    if residual_scale <= 0:
        raise ModelConfigError(f"metadata key {meta.key('residual_scale')!r} must be positive, got {residual_scale}")
    overrides = dict(
        embed_scale=meta.float("embedding_scale", default=1.0, positive=True) / residual_scale,
        eps=meta.float("attention.layer_norm_rms_epsilon", non_negative=True) / residual_scale**2,
        logit_scale=1.0 / meta.float("logit_scale", positive=True),
    )
    if meta.has("attention.scale"):
        overrides["attention_scale"] = meta.float("attention.scale", positive=True)
    return with_scaled_rope(meta, tensors, common_config(meta, tensors, **overrides))
