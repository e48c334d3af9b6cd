"""muser_mlx: run GGUF models on MLX straight from the file's bytes, with hand-written kernels.

Flow: gguf (reader) -> formats (block formats) -> kernels (sources, rendering) -> ops ->
models -> generate. The top level offers what mlx-lm users reach for first:

    from muser_mlx import load, generate
    model, tokenizer = load()            # the packaged SmolLM2-135M-Instruct
    print(generate(model, tokenizer, "The capital of France is", max_tokens=16))
"""

__version__ = "0.1.0"

from muser_mlx.batch import BatchGenerator, batch_generate  # noqa: E402
from muser_mlx.generate import generate, load, stream_generate  # noqa: E402
from muser_mlx.settings import Settings  # noqa: E402

__all__ = ["batch_generate", "BatchGenerator", "generate", "load", "Settings", "stream_generate", "__version__"]
