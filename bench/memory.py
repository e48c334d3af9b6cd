"""Resident memory of a loaded model against its file size (CPU, peak RSS).

Each measurement runs in a fresh process: import (baseline RSS, and the peak reset to it),
load the file and make every tensor's bytes an MLX array, then one forward step. Reported:
peak RSS (VmHWM) above the baseline, divided by the file size.

    python bench/memory.py [--synthetic-gb 1.0] [--model FILE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import mlx.core as mx
mx.set_default_device(mx.cpu)
from muser_mlx.generate import load

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current resident size
base = status("VmRSS")
model, tokenizer = load(sys.argv[1])
for tensor in model.file.tensors.values():
    mx.eval(tensor.data)
loaded = status("VmHWM")
mx.eval(model(mx.array([[1, 2, 3]])))
print(json.dumps({"base": base, "loaded": loaded, "step": status("VmHWM"), "now": status("VmRSS")}))
"""


def measure(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(ROOT)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def synthetic(path: Path, gigabytes: float) -> Path:
    """A llama-shaped Q4_K file of about `gigabytes` (hidden 2048, as many layers as it takes)."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from muser_mlx.testing import tiny_model

    hidden, kv, ff = 2048, 4 * 128, 5632
    per_layer = (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ff) * 144 // 256  # Q4_K bytes
    layers = max(1, math.ceil(gigabytes * 1e9 / per_layer))
    return tiny_model(path, "llama", np.random.default_rng(0), weights="Q4_K", layers=layers,
                      hidden=hidden, heads=16, kv_heads=4, head_dim=128, ff=ff)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", default=[])
    parser.add_argument("--synthetic-gb", type=float, default=1.0)
    args = parser.parse_args()
    paths = [Path(p) for p in args.model]
    if not args.model:
        sys.path.insert(0, str(ROOT))
        from muser_mlx import packaged
        paths.append(packaged.model_path())
        paths.append(synthetic(Path("/tmp/muser-synthetic.gguf"), args.synthetic_gb))
    for path in paths:
        size = path.stat().st_size
        m = measure(path)
        print(f"{path.name}: file {size / 1e6:,.0f} MB; peak RSS above baseline after load "
              f"{(m['loaded'] - m['base']) / 1e6:,.0f} MB ({(m['loaded'] - m['base']) / size:.2f}x the file), "
              f"after one step {(m['step'] - m['base']) / 1e6:,.0f} MB ({(m['step'] - m['base']) / size:.2f}x)")


if __name__ == "__main__":
    main()
