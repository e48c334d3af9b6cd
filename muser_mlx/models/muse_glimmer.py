"""Muse Glimmer (`muse-glimmer`), as ../shared/MUSE_GLIMMER.md describes it.

What differs from a llama: the embedding row is rms-normed (no weight); sandwich norms whose
post-branch eps is a fixed 1e-8; per-head QK norm; a per-channel sigmoid gate on the
attention output; consecutive-pair RoPE on sliding-window layers and none on full-attention
layers; an untied LM head; logits times `logit_scale`, then a tanh softcap.
"""

from muser_mlx.models.config import Metadata, ModelConfig, common_config

ARCHITECTURE = "muse-glimmer"
POST_NORM_EPS = 1e-8  # fixed by the model, not stored in the file
DEFAULT_SOFTCAP = 30.0  # llama.cpp's default when final_logit_softcapping is absent


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    layers = meta.block_count(tensors)
    rope_base = meta.float("rope.freq_base", positive=True)
    return common_config(
        meta, tensors,
        rope_base=rope_base,
        rope_base_swa=meta.float("rope.freq_base_swa", default=rope_base, positive=True),
        rope_full_layers=False,
        tied_embeddings=False,  # output.weight is required
        sliding_window=meta.int("attention.sliding_window"),
        swa_layers=meta.sliding_window_layers(layers),
        qk_norm=True, sandwich_norms=True, post_norm_eps=POST_NORM_EPS, attn_gate=True,
        embed_norm=True, logit_scale=meta.float("logit_scale", positive=True),
        softcap=meta.float("final_logit_softcapping", default=DEFAULT_SOFTCAP, positive=True),
    )
