"""The operations the model graph calls. Each runs our kernel on Metal or CUDA, or the same
math as MLX array ops on the CPU (muser_mlx/dequant.py), on the same raw GGUF bytes.

One module per operation family: embedding, products (the choice of path, GPU products),
cpu_products (CPU products), norm, attention.
"""

from muser_mlx.kernels import MAX_GRID
from muser_mlx.ops.attention import qk_norm_rope, qk_norm_rope_mlx, split_heads
from muser_mlx.ops.cpu_products import MATVEC_MAX_TOKENS
from muser_mlx.ops.embedding import check_token_ids, embedding, embedding_unchecked, make_resident
from muser_mlx.ops.products import (MATVEC_KERNELS, MatvecKernel, dequantize_weight, linear,
                                  linear_path)
from muser_mlx.ops.norm import residual_norm

__all__ = [
    "MAX_GRID", "MATVEC_KERNELS", "MATVEC_MAX_TOKENS", "MatvecKernel", "check_token_ids",
    "dequantize_weight", "embedding", "embedding_unchecked", "linear", "linear_path",
    "make_resident", "qk_norm_rope", "qk_norm_rope_mlx", "residual_norm", "split_heads",
]
