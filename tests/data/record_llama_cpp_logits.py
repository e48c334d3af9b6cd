"""Record llama.cpp's logits for the tiny models of muser_mlx.testing.LLAMA_CPP_CASES (one per
architecture and RoPE scaling): tests/test_llama_cpp_logits.py checks muser_mlx's steps against
the recorded file, llama_cpp_logits.npz beside this script. llama.cpp is the judge; it is never
a dependency of the project: run this by hand when a case changes.

    .venv/bin/python tests/data/record_llama_cpp_logits.py --llama-python /path/to/venv/bin/python

The project's Python writes each case's F32 GGUF and a prompt of LLAMA_CPP_PROMPT token ids,
then runs this script again under a Python with llama-cpp-python (`--run JOB`, which imports
nothing but llama_cpp and numpy): llama.cpp's float path (F32 weights, f32 KV cache, no flash
attention, one thread), the prompt as one batch, then LLAMA_CPP_STEPS greedy steps of one
token. Recorded per case: the token ids (prompt, then the greedy ones), float32 logits
[prompt + steps, vocab] (row i: after token i), and the GGUF's sha256, so that a case whose
file has changed fails by name rather than by its numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).with_name("llama_cpp_logits.npz")


def run(job: Path) -> None:
    """Under llama-cpp-python: job.json lists (name, gguf path, prompt ids, steps); writes
    job.npz with each case's tokens and logits."""
    import numpy as np
    from llama_cpp import Llama

    results = {}
    for name, path, prompt, steps, context in json.loads(job.read_text()):
        llm = Llama(model_path=path, n_ctx=context, n_batch=64, n_ubatch=64, n_threads=1,
                    n_threads_batch=1, logits_all=True, type_k=0, type_v=0, flash_attn=False,
                    n_gpu_layers=0, verbose=False)
        tokens = list(prompt)
        llm.eval(tokens)
        for _ in range(steps):
            tokens.append(int(np.argmax(llm.scores[len(tokens) - 1])))
            llm.eval(tokens[-1:])
        results[f"{name}/tokens"] = np.array(tokens, dtype=np.int32)
        results[f"{name}/logits"] = np.array(llm.scores[: len(tokens)], dtype=np.float32)
        del llm
    np.savez(job.with_suffix(".npz"), **results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python installed")
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("cases", nargs="*", help="cases to record (default: all); others are kept")
    args = parser.parse_args()
    if args.run:
        run(args.run)
        return
    import numpy as np

    from muser_mlx import gguf
    from muser_mlx.testing import LLAMA_CPP_CASES, LLAMA_CPP_PROMPT, LLAMA_CPP_STEPS, llama_cpp_case

    names = args.cases or list(LLAMA_CPP_CASES)
    kept = dict(np.load(OUT)) if OUT.exists() else {}
    with tempfile.TemporaryDirectory() as folder:
        jobs, digests = [], {}
        for name in names:
            path = llama_cpp_case(Path(folder) / f"{name}.gguf", name)
            digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()
            file = gguf.read(path)
            arch = file.metadata["general.architecture"]
            vocab = len(file.metadata["tokenizer.ggml.tokens"])
            prompt = np.random.default_rng(LLAMA_CPP_CASES[name][1]).integers(0, vocab, LLAMA_CPP_PROMPT)
            jobs.append((name, str(path), [int(t) for t in prompt], LLAMA_CPP_STEPS,
                         int(file.metadata[f"{arch}.context_length"])))
        job = Path(folder) / "job.json"
        job.write_text(json.dumps(jobs))
        subprocess.run([args.llama_python, __file__, "--run", str(job)], check=True)
        recorded = dict(np.load(job.with_suffix(".npz")))
    for name in names:
        kept = {k: v for k, v in kept.items() if not k.startswith(f"{name}/")}
        kept[f"{name}/tokens"] = recorded[f"{name}/tokens"]
        kept[f"{name}/logits"] = recorded[f"{name}/logits"]
        kept[f"{name}/sha256"] = np.array(digests[name])
    np.savez_compressed(OUT, **kept)
    print(f"{OUT}: {', '.join(names)} recorded ({OUT.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    sys.exit(main())
