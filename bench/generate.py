"""Real models end to end: prompt tokens/s and decode tokens/s through stream_generate, and
with --llama-cpp the same file, prompt and token counts through llama.cpp in the same run.

For each model (the packaged SmolLM2-135M-Instruct and Gemma 3 270M when installed, or the
files given with --model), a 128-token prompt then 64 greedy tokens (EOS ignored, so every
run generates the same count); the best of --runs runs after a warm-up. Beside decode
tokens/s: the weight bytes one step reads and the floor they imply at the copy bandwidth
measured in the same run.

    python bench/generate.py [--model FILE ...] [--device cpu|gpu] [--llama-cpp PYTHON]
                             [--set field=value ...]   # the models loaded with these Settings
    python bench/generate.py --write-qwen2 FILE    # a 1.5B-parameter qwen2 Q4_K_M file of
                                                   # random valid blocks (Qwen2-1.5B's shapes)

--llama-cpp names a Python interpreter with llama-cpp-python installed (built separately,
e.g. with CMAKE_ARGS="-DGGML_NATIVE=ON"; not a dependency of this project). It is given the
same token ids, runs with as many threads as the machine has cores, and is timed the same way.

--set loads every model with those muser_mlx.settings.Settings (bench/settings_cli.py), e.g.
`--set cpu_rounded=False`: an A/B is two runs, one with the setting and one without.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ceiling import copy_bandwidth  # noqa: E402
from muser_mlx import packaged  # noqa: E402
from muser_mlx.formats import GGMLType, tensor_bytes  # noqa: E402
from muser_mlx.generate import load, stream_generate  # noqa: E402
from muser_mlx.settings import Settings  # noqa: E402
from muser_mlx.testing import bpe_tokenizer_metadata, write_gguf_streaming  # noqa: E402
from settings_cli import HELP, settings_from  # noqa: E402

TEXT = ("The history of the city begins with a small settlement on the river, where traders "
        "from the north and the south met to exchange salt, grain and cloth. ")

# llama.cpp's side, run by the --llama-cpp interpreter: prompt ids in, best tokens/s out.
LLAMA_CPP_SCRIPT = """
import json, sys, time
import numpy as np
from llama_cpp import Llama
args = json.loads(sys.argv[1])
context = max(512, len(args["ids"]) + args["new_tokens"] + 1)  # n_batch too: llama-cpp-python keeps
llm = Llama(args["path"], n_ctx=context, n_batch=context,     # n_batch rows of scores
            n_threads=args["threads"], n_threads_batch=args["threads"], verbose=False)
best_prompt = best_decode = 0.0
for run in range(args["runs"] + 1):  # the first run warms up
    llm.reset()
    tic = time.perf_counter()
    llm.eval(args["ids"])
    prompt = len(args["ids"]) / (time.perf_counter() - tic)
    tic = time.perf_counter()
    for _ in range(args["new_tokens"]):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    decode = args["new_tokens"] / (time.perf_counter() - tic)
    if run:
        best_prompt, best_decode = max(best_prompt, prompt), max(best_decode, decode)
print(json.dumps({"prompt_tps": best_prompt, "decode_tps": best_decode}))
"""


def run(path: Path, prompt_tokens: int, new_tokens: int, runs: int, bandwidth: float,
        llama_cpp: str | None, settings: Settings) -> str:
    model, tokenizer = load(path, settings=settings)
    tokenizer.eos_token_ids = []
    ids = (tokenizer.encode(TEXT * max(40, prompt_tokens // 20 + 1), add_special_tokens=False))[:prompt_tokens]
    prompt_tps = decode_tps = 0.0
    for attempt in range(runs + 1):  # the first run builds kernels and warms caches
        last = None
        for last in stream_generate(model, tokenizer, ids, new_tokens):
            pass
        if attempt:
            prompt_tps, decode_tps = max(prompt_tps, last.prompt_tps), max(decode_tps, last.generation_tps)
    step_bytes = model.weight_bytes()
    floor_tps = bandwidth / step_bytes
    line = (f"{path.name}: prompt {len(ids)} tokens at {prompt_tps:,.0f} tokens/s; "
            f"decode {new_tokens} tokens at {decode_tps:,.1f} tokens/s "
            f"(reads {step_bytes / 1e6:.1f} MB/token; floor {floor_tps:,.0f} tokens/s at "
            f"{bandwidth / 1e9:.1f} GB/s -> {decode_tps / floor_tps:.1%} of it); "
            f"peak {last.peak_memory:.3f} GB")
    if llama_cpp:
        del model
        args = {"path": str(path), "ids": ids, "new_tokens": new_tokens, "runs": runs,
                "threads": os.cpu_count()}
        result = subprocess.run([llama_cpp, "-c", LLAMA_CPP_SCRIPT, json.dumps(args)],
                                capture_output=True, text=True, check=True)
        theirs = json.loads(result.stdout.strip().splitlines()[-1])
        line += (f"\n    llama.cpp: prompt {theirs['prompt_tps']:,.0f} tokens/s, decode "
                 f"{theirs['decode_tps']:,.1f} tokens/s -> muser_mlx is "
                 f"{prompt_tps / theirs['prompt_tps']:.2f}x (prompt), "
                 f"{decode_tps / theirs['decode_tps']:.2f}x (decode)")
    return line


# Qwen2-1.5B's shapes; the Q4_K_M mix as llama.cpp writes it (Q6_K for the LM head and for
# attn_v / ffn_down in half the layers, Q4_K elsewhere).
QWEN2 = dict(hidden=1536, ff=8960, layers=28, heads=12, kv_heads=2, head_dim=128, vocab=151936)
F16_FIELDS = {GGMLType.Q4_K: (0, 2), GGMLType.Q6_K: (208,)}
BLOCK_BYTES = {GGMLType.Q4_K: 144, GGMLType.Q6_K: 210}


def write_qwen2(path: Path, rng) -> None:
    """A qwen2 file of Qwen2-1.5B's shapes and Q4_K_M mix, of random valid blocks (small f16
    scales), with a byte-level BPE vocabulary padded to 151,936 tokens."""
    h, ff, kv = QWEN2["hidden"], QWEN2["ff"], QWEN2["kv_heads"] * QWEN2["head_dim"]
    q = QWEN2["heads"] * QWEN2["head_dim"]
    infos = []

    def add(name, ggml_type, shape):
        infos.append((name, ggml_type, shape, tensor_bytes(ggml_type, shape)))

    add("token_embd.weight", GGMLType.Q4_K, (h, QWEN2["vocab"]))
    for i in range(QWEN2["layers"]):
        p = f"blk.{i}."
        more_bits = GGMLType.Q6_K if i % 2 == 0 else GGMLType.Q4_K
        add(p + "attn_norm.weight", GGMLType.F32, (h,))
        add(p + "ffn_norm.weight", GGMLType.F32, (h,))
        for name, size in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            add(p + name + ".bias", GGMLType.F32, (size,))
        add(p + "attn_q.weight", GGMLType.Q4_K, (h, q))
        add(p + "attn_k.weight", GGMLType.Q4_K, (h, kv))
        add(p + "attn_v.weight", more_bits, (h, kv))
        add(p + "attn_output.weight", GGMLType.Q4_K, (q, h))
        add(p + "ffn_gate.weight", GGMLType.Q4_K, (h, ff))
        add(p + "ffn_up.weight", GGMLType.Q4_K, (h, ff))
        add(p + "ffn_down.weight", more_bits, (ff, h))
    add("output_norm.weight", GGMLType.F32, (h,))
    add("output.weight", GGMLType.Q6_K, (h, QWEN2["vocab"]))

    pools = {}
    for ggml_type, block in BLOCK_BYTES.items():
        blocks = rng.integers(0, 256, size=((64 << 20) // block, block), dtype=np.uint8)
        for start in F16_FIELDS[ggml_type]:
            blocks[:, start : start + 2] = rng.uniform(1e-4, 4e-3, size=(blocks.shape[0], 1)) \
                .astype(np.float16).view(np.uint8)
        pools[ggml_type] = blocks.reshape(-1)

    def fill(name, ggml_type, nbytes):
        if ggml_type == GGMLType.F32:
            scale = 0.1 if name.endswith(".bias") else 1.0
            return (scale * rng.uniform(0.5, 1.5, size=nbytes // 4)).astype(np.float32).view(np.uint8)
        pool = pools[ggml_type]
        return pool[:nbytes] if nbytes <= pool.size else np.resize(pool, nbytes)

    tokenizer = bpe_tokenizer_metadata(pre="qwen2")
    tokens = tokenizer["tokenizer.ggml.tokens"]
    padding = QWEN2["vocab"] - len(tokens)
    tokenizer["tokenizer.ggml.tokens"] = tokens + [f"<|unused_{i}|>" for i in range(padding)]
    tokenizer["tokenizer.ggml.token_type"] = tokenizer["tokenizer.ggml.token_type"] + [5] * padding
    for key in ("bos", "eos", "eot"):  # llama.cpp reads token ids as u32
        tokenizer[f"tokenizer.ggml.{key}_token_id"] = ("u32", tokenizer[f"tokenizer.ggml.{key}_token_id"])
    metadata = {
        "general.architecture": "qwen2",
        "qwen2.block_count": ("u32", QWEN2["layers"]),
        "qwen2.context_length": ("u32", 32768),
        "qwen2.embedding_length": ("u32", h),
        "qwen2.feed_forward_length": ("u32", ff),
        "qwen2.attention.head_count": ("u32", QWEN2["heads"]),
        "qwen2.attention.head_count_kv": ("u32", QWEN2["kv_heads"]),
        "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen2.rope.freq_base": 1000000.0,
        **tokenizer,
    }
    write_gguf_streaming(path, metadata, infos, fill)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", help="GGUF file(s); default: the packaged models")
    parser.add_argument("--device", choices=["cpu", "gpu"])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="timed runs (best kept), after a warm-up")
    parser.add_argument("--llama-cpp", metavar="PYTHON", help="also time llama.cpp through this interpreter")
    parser.add_argument("--write-qwen2", metavar="FILE", help="write the 1.5B qwen2 file and exit")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help=f"load the models with these settings: {HELP}")
    args = parser.parse_args()
    settings = settings_from(args.set)
    if args.write_qwen2:
        write_qwen2(Path(args.write_qwen2), np.random.default_rng(0))
        return
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
    print(f"device {mx.default_device()}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write); "
          f"load average {os.getloadavg()[0]:.2f}; settings {args.set or 'none'}")
    for path in paths:
        print(run(path, args.prompt_tokens, args.new_tokens, args.runs, bandwidth, args.llama_cpp, settings),
              flush=True)


if __name__ == "__main__":
    main()
