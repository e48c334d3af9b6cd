"""The operations the model graph calls. Each runs our kernel on Metal or CUDA, or the same
math on the CPU (a compiled primitive, cpu_ext; else MLX array ops, muser_mlx/dequant.py), on
the same raw GGUF bytes.

One module per operation family: embedding; activations (x as int8 blocks, q8x); products
(`linear`, the one place a product's path is chosen, and the generic GPU matvec); gpu_products (the fused decode
step's q8x products); dequantize (the GPU prefill's weight decode and matmul); pacer (the GPU
prefill's pacing); cpu_products (the CPU's products); norm; attention.
"""

from muser_mlx.kernels import MAX_GRID
from muser_mlx.ops.activations import Q8X, WovenQ8X, gelu_tanh, glu, glu_quantize_rows, quantize_rows, weave
from muser_mlx.ops.attention import (attention, attention_decode, attention_dtype, qk_norm_rope, qk_norm_rope_mlx,
                                     split_heads)
from muser_mlx.ops.cpu_products import MATVEC_MAX_TOKENS
from muser_mlx.ops.dequantize import dequantize_into, dequantize_weight
from muser_mlx.ops.embedding import check_token_ids, embedding, embedding_unchecked, make_resident
from muser_mlx.ops.gpu_products import (PRODUCT_FORMATS, GatedProduct, NoProductKernelError, Product, TileProduct,
                                        greedy, product, product_glu)
from muser_mlx.ops.products import linear, linear_path, rounded_products
from muser_mlx.ops.norm import residual_norm, residual_norm_quant
from muser_mlx.ops.pacer import paced_products
from muser_mlx.settings import ProductConfig

__all__ = [
    "MATVEC_MAX_TOKENS", "MAX_GRID", "PRODUCT_FORMATS", "Q8X", "WovenQ8X",
    "attention", "attention_decode", "attention_dtype", "check_token_ids", "dequantize_into", "dequantize_weight",
    "embedding", "embedding_unchecked", "GatedProduct", "gelu_tanh", "glu", "glu_quantize_rows", "greedy", "linear", "linear_path",
    "make_resident", "NoProductKernelError", "paced_products", "product", "Product", "product_glu", "TileProduct",
    "ProductConfig", "qk_norm_rope", "qk_norm_rope_mlx", "quantize_rows", "residual_norm",
    "residual_norm_quant", "rounded_products", "split_heads", "weave",
]
