"""The operations the model graph calls. Each runs our kernel on Metal or CUDA, or the same
math as MLX array ops on the CPU (muser_mlx/dequant.py), on the same raw GGUF bytes.

One module per operation family: embedding, activations (x as int8 blocks), products (the
choice of path, GPU products), cpu_products (CPU products), fused_products (the fused decode
step's q8x products), norm, attention.
"""

from muser_mlx.kernels import MAX_GRID
from muser_mlx.ops.attention import (attention, attention_decode, attention_dtype, qk_norm_rope, qk_norm_rope_mlx,
                                     split_heads)
from muser_mlx.ops.cpu_products import MATVEC_MAX_TOKENS
from muser_mlx.ops.embedding import check_token_ids, embedding, embedding_unchecked, make_resident
from muser_mlx.ops.activations import Q8X, WovenQ8X, quantize_rows, weave
from muser_mlx.ops.fused_products import (GLU_CONFIG_BY_WIDTH, PRODUCT_CONFIG, PRODUCT_CONFIG_BY_WIDTH, PRODUCT_FORMATS, GatedProduct,
                                          NoProductKernelError, Product, ProductConfig, gelu_tanh,
                                          greedy, product, product_glu)
from muser_mlx.ops.products import (MATVEC_KERNELS, MatvecKernel, dequantize_weight, linear, linear_path,
                                    paced_products, rounded_products)
from muser_mlx.ops.norm import residual_norm, residual_norm_quant

__all__ = [
    "MATVEC_KERNELS", "MATVEC_MAX_TOKENS", "MAX_GRID", "PRODUCT_CONFIG", "PRODUCT_CONFIG_BY_WIDTH", "GLU_CONFIG_BY_WIDTH", "PRODUCT_FORMATS", "Q8X",
    "attention", "attention_decode", "attention_dtype", "check_token_ids", "dequantize_weight", "embedding",
    "embedding_unchecked", "GatedProduct", "gelu_tanh", "greedy", "linear", "linear_path",
    "make_resident", "MatvecKernel", "NoProductKernelError", "paced_products", "product", "Product", "product_glu",
    "ProductConfig", "qk_norm_rope", "qk_norm_rope_mlx", "quantize_rows", "residual_norm",
    "residual_norm_quant", "rounded_products", "split_heads", "weave", "WovenQ8X",
]
