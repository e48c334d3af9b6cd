"""muser_mlx: run GGUF models on MLX straight from the file's bytes, with hand-written kernels.

Flow: gguf (reader) -> formats (block formats) -> kernels (sources, rendering) -> ops -> models.
"""

__version__ = "0.1.0"
