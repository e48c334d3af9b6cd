"""Real models end to end: prompt tokens/s and decode tokens/s through stream_generate.

For each model (the packaged SmolLM2-135M-Instruct and Gemma 3 270M when installed, or the
files given with --model), a 128-token prompt then 64 greedy tokens (EOS ignored, so every
run generates the same count). Beside decode tokens/s: the weight bytes one step reads and
the floor they imply at the copy bandwidth measured in the same run.

    python bench/generate.py [--model FILE ...] [--device cpu|gpu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ceiling import copy_bandwidth  # noqa: E402
from muser_mlx import packaged  # noqa: E402
from muser_mlx.generate import load, stream_generate  # noqa: E402

TEXT = ("The history of the city begins with a small settlement on the river, where traders "
        "from the north and the south met to exchange salt, grain and cloth. ")


def run(path: Path, prompt_tokens: int, new_tokens: int, bandwidth: float) -> str:
    model, tokenizer = load(path)
    tokenizer.eos_token_ids = []
    ids = (tokenizer.encode(TEXT * 40, add_special_tokens=False))[:prompt_tokens]
    for _ in range(2):  # the first run builds kernels and warms caches
        last = None
        for last in stream_generate(model, tokenizer, ids, new_tokens):
            pass
    step_bytes = model.weight_bytes()
    floor_tps = bandwidth / step_bytes
    return (f"{path.name}: prompt {last.prompt_tokens} tokens at {last.prompt_tps:,.0f} tokens/s; "
            f"decode {last.generation_tokens} tokens at {last.generation_tps:,.1f} tokens/s "
            f"(reads {step_bytes / 1e6:.1f} MB/token; floor {floor_tps:,.0f} tokens/s at "
            f"{bandwidth / 1e9:.1f} GB/s -> {last.generation_tps / floor_tps:.1%} of it); "
            f"peak {last.peak_memory:.3f} GB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", help="GGUF file(s); default: the packaged models")
    parser.add_argument("--device", choices=["cpu", "gpu"])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.device:
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    paths = [Path(p) for p in args.model or []]
    if not paths:
        for name in packaged.MODELS:
            try:
                paths.append(packaged.model_path(name))
            except packaged.ModelNotInstalledError as error:
                print(f"skipping {name}: {error}")
    bandwidth = copy_bandwidth(512 << 20)
    print(f"device {mx.default_device()}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write)")
    for path in paths:
        print(run(path, args.prompt_tokens, args.new_tokens, bandwidth), flush=True)


if __name__ == "__main__":
    main()
