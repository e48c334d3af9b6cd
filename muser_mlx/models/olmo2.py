"""OLMo 2 (`olmo2`). What differs from a llama: no norm before a branch, which reads the
residual stream itself; an RMS norm on each branch's output before it joins the stream
(post_attention_norm, post_ffw_norm: the sandwich post-norms alone); q and k RMS-normed each
over its whole projection (attn_q_norm [heads * head_dim], attn_k_norm [kv_heads * head_dim])
before the head split, then halves-rotating RoPE (llama.cpp's NEOX); an untied LM head.

OLMo 3's files say `olmo2` with a sliding window on three layers of four; that is refused."""

from muser_mlx.models.config import Metadata, ModelConfig, ModelConfigError, common_config, with_scaled_rope

ARCHITECTURE = "olmo2"


def config(metadata: dict, tensors: dict) -> ModelConfig:
    meta = Metadata(metadata, ARCHITECTURE)
    if meta.int("attention.sliding_window", default=0, minimum=0) > 0:
        raise ModelConfigError(f"metadata key {meta.key('attention.sliding_window')!r}: an olmo2 model "
                               f"with sliding-window layers (OLMo 3) is not supported")
    config = common_config(meta, tensors, every_layer="attn_output.weight", rope_traditional=False,
                           pre_norms=False, sandwich_norms=True, qk_norm=True, qk_norm_whole=True,
                           tied_embeddings=False)
    return with_scaled_rope(meta, tensors, config)
