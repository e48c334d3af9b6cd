"""Muse Glimmer at full scale: decode ms/token and prefill tokens/s, next to the floor.

Writes a full-size random-weight `muse-glimmer` GGUF (52 layers, hidden 6656, vocab 202048; a
q4_k_xl-like mix sized close to the pinned artifact's 16,756,681,056 bytes) as valid blocks,
straight from random bytes (only the f16 scale fields are set, to small finite values), loads
it with our loader and times:
- decode: the fused decode step (`Transformer.decode_step`, as generate() runs it: 52 layers,
  LM head, greedy argmax) at context 0, 2048 and 8192, median of N steps after warm-up: one
  step per evaluation (with the host's share: building the step), and pipelined as
  generate()'s loop (the next step queued before the last token is read);
- prefill: 512-row chunks (`model.hidden` + the last row's logits), tokens/s.
Floor = weight bytes one decode step reads / copy bandwidth measured in the same run
(an elementwise device copy of 4 GiB, read + write bytes counted).

    python bench/decode.py [--dir /dev/shm] [--steps 20] [--keep] [--general] [--no-compile]
                           [--repeats 1] [--step-times] [--run-spans] [--threaded]
                           [--set field=value ...] [--variant NAME:field=value,...] [--fill-trace]

--set loads the model with those muser_mlx.settings.Settings (bench/settings_cli.py), e.g.
`--set attention_splits=64`; --no-compile is `--set compile_decode=False` (the fused step
without mx.compile).

--variant (repeatable) also times the fused step pipelined with other settings, e.g.
`--variant hg1:attention_head_group=1`: the model is rebuilt with them over the same file (its
stacked projections copied anew, the old model freed), and back for the default.

--repeats N measures every pipelined figure N times, the default and the variants in turn, and
prints the median with each run (identical code measured twice in one process has differed by
up to 2 ms on a lent H200).

--step-times prints each step of one more pipelined run of the default: its time, the host's
build, and the build with the queuing (async_eval), to tell a slow host from a waiting one.

--run-spans prints each pipelined run's wall-clock span and median, to line a run up with an
outside log (`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 50`):
whole runs came out fast or ~1 ms a step slow, and the clocks were the same in both.

--threaded also times the fused step pipelined with a second thread that queues and waits while
the main thread builds (threaded_decode_ms): whether overlapping the host's build and queuing
would help a slow host.

--general also times the general step (model(...): MLX ops around float32-x matvec kernels) the
fused one replaces.

--fill-trace prints each 512-position chunk's peak while a context is filled, and what stays
active after it: the filling peak of 8,192 positions ranged 1.086-1.118x the file across three
processes of the same code before prefill's pacer also bounded active memory
(Settings.prefill_headroom; bench/prefill_memory.py measures it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import queue
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ceiling import copy_bandwidth  # noqa: E402
from muser_mlx import gguf, ops  # noqa: E402
from muser_mlx.formats import GGMLType, tensor_bytes  # noqa: E402
from muser_mlx.generate import decode, load  # noqa: E402
from muser_mlx.ops import pacer  # noqa: E402
from muser_mlx.testing import bpe_tokenizer_metadata, write_gguf_streaming  # noqa: E402
from muser_mlx.tokenizer import UNUSED  # noqa: E402
from settings_cli import HELP, parse_variant, rebuilt, settings_from  # noqa: E402

ARTIFACT_BYTES = 16_756_681_056
H, FF, VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 6656, 19968, 202048, 52, 32, 2, 128
# Byte offsets of f16 scale fields inside one block, per format: set to small finite values.
F16_FIELDS = {GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,), GGMLType.Q8_0: (0,)}
BLOCK_BYTES = {GGMLType.Q4_K: 144, GGMLType.Q5_K: 176, GGMLType.Q6_K: 210, GGMLType.Q8_0: 34}


def tensor_infos(q6k_ffn_down_layers: int, layers: int = LAYERS):
    """(name, type, GGUF shape, nbytes) of every tensor; the mix: Q4_K everywhere, the LM head
    Q6_K, attn_k/attn_v Q8_0, ffn_down Q6_K on the first `q6k_ffn_down_layers` layers."""
    infos = []

    def add(name, ggml_type, shape):
        infos.append((name, ggml_type, shape, tensor_bytes(ggml_type, shape)))

    add("token_embd.weight", GGMLType.Q4_K, (H, VOCAB))
    for i in range(layers):
        p = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            add(p + norm + ".weight", GGMLType.F32, (H,))
        add(p + "attn_q_norm.weight", GGMLType.F32, (HEAD_DIM,))
        add(p + "attn_k_norm.weight", GGMLType.F32, (HEAD_DIM,))
        add(p + "attn_q.weight", GGMLType.Q4_K, (H, HEADS * HEAD_DIM))
        add(p + "attn_gate.weight", GGMLType.Q4_K, (H, HEADS * HEAD_DIM))
        add(p + "attn_k.weight", GGMLType.Q8_0, (H, KV_HEADS * HEAD_DIM))
        add(p + "attn_v.weight", GGMLType.Q8_0, (H, KV_HEADS * HEAD_DIM))
        add(p + "attn_output.weight", GGMLType.Q4_K, (HEADS * HEAD_DIM, H))
        add(p + "ffn_gate.weight", GGMLType.Q4_K, (H, FF))
        add(p + "ffn_up.weight", GGMLType.Q4_K, (H, FF))
        add(p + "ffn_down.weight", GGMLType.Q6_K if i < q6k_ffn_down_layers else GGMLType.Q4_K, (FF, H))
    add("output_norm.weight", GGMLType.F32, (H,))
    add("output.weight", GGMLType.Q6_K, (H, VOCAB))
    return infos


def closest_mix(layers: int = LAYERS):
    """The number of Q6_K ffn_down layers that brings the file nearest the artifact's size."""
    target = ARTIFACT_BYTES * layers / LAYERS
    sizes = [(abs(sum(i[3] for i in tensor_infos(n, layers)) - target), n) for n in range(layers + 1)]
    return min(sizes)[1]


def random_pools(rng, pool_bytes: int):
    """One pool of valid random blocks per format; tensors are cut from these."""
    pools = {}
    for ggml_type, block in BLOCK_BYTES.items():
        blocks = rng.integers(0, 256, size=(pool_bytes // block, block), dtype=np.uint8)
        for start in F16_FIELDS[ggml_type]:
            scale = rng.uniform(1e-4, 4e-3, size=blocks.shape[0]).astype(np.float16)
            blocks[:, start : start + 2] = scale.view(np.uint8).reshape(-1, 2)
        pools[ggml_type] = blocks.reshape(-1)
    return pools


def write_file(path: Path, rng, layers: int = LAYERS) -> int:
    pools = random_pools(rng, 256 << 20)

    def fill(name, ggml_type, nbytes):
        if ggml_type == GGMLType.F32:
            return rng.uniform(0.5, 1.5, size=nbytes // 4).astype(np.float32).view(np.uint8)
        pool = pools[ggml_type]  # whole blocks; repeated for tensors larger than the pool
        return pool[:nbytes] if nbytes <= pool.size else np.resize(pool, nbytes)

    metadata = {
        "general.architecture": "muse-glimmer",
        "muse-glimmer.block_count": ("u32", layers),
        "muse-glimmer.context_length": ("u32", 131072),
        "muse-glimmer.embedding_length": ("u32", H),
        "muse-glimmer.feed_forward_length": ("u32", FF),
        "muse-glimmer.attention.head_count": ("u32", HEADS),
        "muse-glimmer.attention.head_count_kv": ("u32", KV_HEADS),
        "muse-glimmer.attention.key_length": ("u32", HEAD_DIM),
        "muse-glimmer.attention.value_length": ("u32", HEAD_DIM),
        "muse-glimmer.attention.layer_norm_rms_epsilon": 1e-5,
        "muse-glimmer.rope.freq_base": 500000.0,
        "muse-glimmer.attention.sliding_window": ("u32", 2048),
        "muse-glimmer.attention.sliding_window_pattern": [i % 4 < 3 for i in range(layers)],
        "muse-glimmer.logit_scale": 0.19611613513818404,
        "muse-glimmer.final_logit_softcapping": 20.0,
    }
    metadata.update(bpe_tokenizer_metadata())
    # The vocabulary padded to the embedding's rows with unused tokens: llama.cpp takes its
    # vocabulary size from the token list and refuses a table of more rows.
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    metadata["tokenizer.ggml.tokens"] = tokens + [f"<|unused_{i}|>" for i in range(VOCAB - len(tokens))]
    metadata["tokenizer.ggml.token_type"] = types + [UNUSED] * (VOCAB - len(types))
    infos = tensor_infos(closest_mix(layers), layers)
    write_gguf_streaming(path, metadata, infos, fill)
    return path.stat().st_size


def peak_gb() -> str:
    """MLX's peak memory since the last call (then reset), for a per-stage account."""
    peak = mx.get_peak_memory() / 1e9
    mx.reset_peak_memory()
    return f"peak {peak:.2f} GB"


def general_step(model, token, cache):
    """The general step generate() ran before the fused one: model(...) and an argmax."""
    logits = model.logits(model.hidden_unchecked(token, cache))
    return mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)


def fused_step(model, token, cache):
    """generate()'s step: the fused decode graph, its LM head's greedy token (on the CPU, a
    smoke run: its compiled step and an argmax)."""
    logits, greedy = decode(model, token, cache)
    if greedy is None:
        greedy = mx.argmax(logits).astype(mx.int32)
    return greedy.reshape(1, 1)


def decode_ms(step, model, cache, steps: int) -> tuple[float, float]:
    """One token per evaluation, each step waiting for the last: median ms per token, and of
    that the ms spent building the step's graph in Python (before any of it runs)."""
    token = mx.array([[7]], dtype=mx.int32)
    times, builds = [], []
    for _ in range(steps + 3):
        tic = time.perf_counter()
        token = step(model, token, cache)
        builds.append(time.perf_counter() - tic)
        mx.eval(token)
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times[3:]), 1e3 * statistics.median(builds[3:])


def pipelined_decode_ms(step, model, cache, steps: int, trace: list | None = None,
                        mark=lambda name: contextlib.nullcontext()) -> float:
    """As generate()'s loop runs: step n+1's graph is built from step n's lazy token and
    queued (async_eval) before waiting for step n, so building overlaps the GPU's work.
    trace: gets each step's (ms in all, building, building + queuing): MLX's async_eval waits
    while its maximum of tasks (CUDA graphs, of up to 100 operations on sm_90) is in flight.
    mark(name): a context manager around each step's "build", "queue" and "wait" (a profiler's
    marks, bench/timeline.py)."""
    pending = step(model, mx.array([[7]], dtype=mx.int32), cache)
    mx.async_eval(pending)
    times = []
    for _ in range(steps + 3):
        tic = time.perf_counter()
        with mark("build"):
            following = step(model, pending, cache)
        built = time.perf_counter()
        with mark("queue"):
            mx.async_eval(following)
        queued = time.perf_counter()
        with mark("wait"):
            mx.eval(pending)
        pending = following
        times.append(time.perf_counter() - tic)
        if trace is not None:
            trace.append(tuple(1e3 * s for s in (times[-1], built - tic, queued - tic)))
    mx.eval(pending)
    return 1e3 * statistics.median(times[3:])


def threaded_decode_ms(step, model, cache, steps: int) -> float:
    """Pipelined with a second thread, to overlap the host's two parts of a step: while a
    queuing thread queues step n+1 (mx.async_eval, which releases the GIL) and then waits for
    step n, the main thread builds step n+2's graph from step n+1's lazy token. In
    pipelined_decode_ms one thread does both in turn, so on a slow host a step costs the host
    build + queue. The steps run on a stream any thread may use
    (mx.new_thread_unsafe_stream); only the queuing thread evaluates."""
    # main() made this stream (thread-unsafe: any thread may use it) the default before the
    # model was loaded, so no array of the step belongs to a thread's own stream: evaluating
    # such an array from the queuing thread fails ("There is no Stream(gpu, 0) in current
    # thread", on the H200).
    stream = mx.default_stream(mx.default_device())
    jobs, done = queue.Queue(), queue.Queue()

    def queuing():
        mx.set_default_stream(stream)
        while (job := jobs.get()) is not None:
            to_queue, to_wait = job
            try:
                if to_queue is not None:
                    mx.async_eval(to_queue)
                if to_wait is not None:
                    mx.eval(to_wait)
                done.put(None)
            except BaseException as error:  # handed to the main thread, raised there
                done.put(error)

    def finished():
        error = done.get()
        if error is not None:
            raise error

    thread = threading.Thread(target=queuing, name="decode-queuing", daemon=True)
    thread.start()
    times = []
    try:
        with mx.stream(stream):
            pending = step(model, mx.array([[7]], dtype=mx.int32), cache)
            jobs.put((pending, None))
            following = step(model, pending, cache)  # built while `pending` is queued
            finished()
            for _ in range(steps + 3):
                tic = time.perf_counter()
                jobs.put((following, pending))  # queue step n+1, then wait for step n ...
                after = step(model, following, cache)  # ... while step n+2 is built here
                finished()
                pending, following = following, after
                times.append(time.perf_counter() - tic)
            jobs.put((following, pending))
            finished()
            jobs.put((None, following))
            finished()
    finally:
        jobs.put(None)
        thread.join()
    return 1e3 * statistics.median(times[3:])


def linears_only_ms(model, steps: int) -> float:
    """The same step's matrix products alone (every layer's products and the LM head, on
    random activations, one evaluation): the part of a step the weight bytes pay for."""
    weights = model.matrices()
    x = {n: mx.random.normal((1, n)) for n in {w.shape[0] for w in weights}}
    times = []
    for _ in range(steps + 3):
        tic = time.perf_counter()
        outs = [ops.linear(x[w.shape[0]], w) for w in weights]
        mx.eval(outs)
        times.append(time.perf_counter() - tic)
    return 1e3 * statistics.median(times[3:])


def fill_context(model, cache, tokens: int, rng, chunk: int = 512, trace: bool = False) -> list[int]:
    """Prefill `tokens` random positions into `cache`, `chunk` at a time, one evaluation a
    chunk; returns each chunk's peak memory (bytes, MLX's count: the model's arrays included).
    trace: also print each chunk's peak and the memory still active after it, to tell a peak
    that grows with the context from one that varies between runs of the same code."""
    peaks = []
    while cache[0].offset < tokens:
        n = min(chunk, tokens - cache[0].offset)
        mx.reset_peak_memory()
        mx.eval(model.hidden(mx.array(rng.integers(0, 1000, size=(1, n)), dtype=mx.int32), cache))
        peaks.append(mx.get_peak_memory())
        if trace:
            print(f"  filled to {cache[0].offset:6d}: chunk peak {peaks[-1] / 1e9:.2f} GB, "
                  f"active after it {mx.get_active_memory() / 1e9:.2f} GB", flush=True)
    return peaks


def spread(runs: list[float]) -> str:
    """'' for one run; else each run's ms, for the median printed before it."""
    return "" if len(runs) < 2 else f" (median of {len(runs)} runs: {', '.join(f'{r:.2f}' for r in runs)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefill-chunks", type=int, default=6)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--layers", type=int, default=LAYERS, help="fewer layers: a quick smoke run")
    parser.add_argument("--contexts", default="0,2048,8192")
    parser.add_argument("--fill-trace", action="store_true",
                        help="print each prefill chunk's peak memory while filling a context")
    parser.add_argument("--repeats", type=int, default=1,
                        help="pipelined figures: rounds of the default and every variant in turn (median)")
    parser.add_argument("--general", action="store_true",
                        help="also time the general step the fused one replaces")
    parser.add_argument("--no-compile", action="store_true",
                        help="the fused step without mx.compile (--set compile_decode=False)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help=f"load the model with these settings: {HELP}")
    parser.add_argument("--step-times", action="store_true",
                        help="also print each pipelined step's time, its build and its queuing")
    parser.add_argument("--run-spans", action="store_true",
                        help="also print each pipelined run's wall-clock span and median (to match a run "
                             "with an outside log, e.g. nvidia-smi's clocks)")
    parser.add_argument("--threaded", action="store_true",
                        help="also time the fused step pipelined with a second thread queuing and waiting "
                             "while the main thread builds (threaded_decode_ms)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                        help="also the fused step pipelined with the model rebuilt with these settings")
    args = parser.parse_args()
    settings = settings_from(args.set + (["compile_decode=False"] if args.no_compile else []))
    variant_settings = {}
    for variant in args.variant:
        name, changes = parse_variant(variant)
        variant_settings[variant] = (name, changes, settings_from(changes, settings))
    if args.prefill_chunks == 1 or args.prefill_chunks < 0:
        parser.error("--prefill-chunks: 0 (no prefill figure) or at least 2 (the first chunk builds the "
                     f"kernels and is not timed), got {args.prefill_chunks}")
    if args.threaded:  # every array on one stream any thread may use (threaded_decode_ms)
        mx.set_default_stream(mx.new_thread_unsafe_stream(mx.default_device()))
    rng = np.random.default_rng(0)
    path = Path(args.dir) / f"muse-glimmer-random-{args.layers}.gguf"
    print(f"device: {mx.default_device()}", flush=True)
    tic = time.perf_counter()
    if not path.exists():
        size = write_file(path, rng, args.layers)
        print(f"wrote {path}: {size:,} B ({size / ARTIFACT_BYTES:.4f} of the artifact's size) in "
              f"{time.perf_counter() - tic:.1f} s", flush=True)
    bandwidth = copy_bandwidth(4 << 30)
    print(f"copy bandwidth (4 GiB elementwise, read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)

    tic = time.perf_counter()
    model, _ = load(path, settings=settings)
    for tensor in model.file.tensors.values():
        mx.eval(tensor.data)
    print(f"loaded in {time.perf_counter() - tic:.1f} s ({peak_gb()}); by type: "
          f"{ {k: f'{v / 1e9:.2f} GB' for k, v in gguf.read(path).bytes_by_type().items()} }", flush=True)
    weight_bytes = model.weight_bytes()
    floor_ms = 1e3 * weight_bytes / bandwidth
    print(f"weight bytes per decode step: {weight_bytes:,} -> floor {floor_ms:.2f} ms/token", flush=True)

    linear_ms = linears_only_ms(model, args.steps)
    print(f"matrix products alone (all linears of one step, one evaluation): {linear_ms:.2f} ms "
          f"({weight_bytes / linear_ms / 1e6:,.0f} GB/s; {peak_gb()})", flush=True)
    if args.set:
        print(f"settings: {', '.join(args.set)}", flush=True)
    print(f"fused decode step: {model.fused} (mx.compile: {model.gpu_step.compiled})", flush=True)
    variants = [("fused", fused_step)] + ([("general", general_step)] if args.general else [])
    for context in (int(c) for c in args.contexts.split(",")):
        cache = model.make_cache()
        peaks = fill_context(model, cache, context, rng, trace=args.fill_trace)
        mx.reset_peak_memory()
        filled = f"peak {max(peaks) / 1e9:.2f} GB" if peaks else "nothing"
        for label, step in variants:
            ms, build_ms = decode_ms(step, model, cache, args.steps)
            kv = sum(c.nbytes for c in cache)
            print(f"{label} decode at context {context:5d}: {ms:7.2f} ms/token one step at a time "
                  f"({ms / floor_ms:.2f}x the floor {floor_ms:.2f} ms; {build_ms:.2f} ms of it building "
                  f"the step; KV cache {kv / 1e6:.0f} MB; filling it: {filled}; decoding: {peak_gb()})",
                  flush=True)
        # Pipelined: the default and each variant in turn, --repeats rounds (each recompiled,
        # so that the rounds' order and recompiles weigh on every row alike); median and range.
        runs = ({label: [] for label, _ in variants} | {variant: [] for variant in args.variant}
                | ({"threaded": []} if args.threaded else {}))
        spans = []

        def timed(name, step, how=pipelined_decode_ms):  # one run, its wall-clock span kept for --run-spans
            clock = lambda: datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]  # noqa: E731
            start = clock()
            runs[name].append(how(step, model, cache, args.steps))
            spans.append(f"{name.split(':')[0]} {start}-{clock()} {runs[name][-1]:.2f}")

        for _ in range(args.repeats):
            for label, step in variants:
                model.gpu_step.retrace()
                timed(label, step)
            for variant, (_, _, changed) in variant_settings.items():
                model = rebuilt(model, changed)
                gc.collect()  # the model replaced (and its stacked projections) freed
                timed(variant, fused_step)
            model = rebuilt(model, settings)  # the default again
            gc.collect()
            if "threaded" in runs:  # --threaded, and no run of it has failed
                model.gpu_step.retrace()  # traced again, on the queuing thread's stream
                try:
                    timed("threaded", fused_step, threaded_decode_ms)
                except Exception as error:  # report it, keep the other figures
                    traceback.print_exc()
                    print(f"  threaded run failed: {type(error).__name__}: {error}", flush=True)
                    del runs["threaded"]
            model.gpu_step.retrace()
        if args.run_spans:
            print(f"  runs (wall clock, median ms): {'; '.join(spans)}", flush=True)
        if args.step_times:  # one more run of the default, each step's times
            model.gpu_step.retrace()
            trace = []
            pipelined_decode_ms(fused_step, model, cache, args.steps, trace)
            print(f"  each step (ms in all / building / building + queuing): "
                  f"{' '.join(f'{a:.2f}/{b:.2f}/{c:.2f}' for a, b, c in trace[3:])}", flush=True)
        for label, _ in variants:
            pipelined = statistics.median(runs[label])
            print(f"  {label} pipelined (generate's loop): {pipelined:7.2f} ms/token "
                  f"({pipelined / floor_ms:.2f}x the floor; {1e3 / pipelined:.1f} tokens/s){spread(runs[label])}",
                  flush=True)
        if "threaded" in runs:
            threaded = statistics.median(runs["threaded"])
            print(f"  threaded (a second thread queues and waits while this one builds): {threaded:7.2f} "
                  f"ms/token{spread(runs['threaded'])}", flush=True)
        for variant, (name, changes, _) in variant_settings.items():
            print(f"  variant {name} ({','.join(changes)}) pipelined: {statistics.median(runs[variant]):7.2f} ms/token"
                  f"{spread(runs[variant])}", flush=True)

    if args.prefill_chunks:
        prefill_figure(model, rng, args.prefill_chunks)
    print(f"file {path.stat().st_size / 1e9:.2f} GB; each peak above is MLX's own count for that "
          f"stage, the model's arrays included", flush=True)
    if not args.keep:
        path.unlink()


class PacerWaits(contextlib.AbstractContextManager):
    """Within this block: the seconds GPU prefill's pacer (ops.pacer.Pacer.make_room) spends
    waiting for queued products, and how many of its calls waited; and the seconds its queue()
    spends handing each product to MLX (mx.async_eval: MLX encodes every op built since the
    last one and commits its CUDA graph), `queued`. (The class's methods are wrapped for the
    block: a timing hook, not a setting.)"""

    def __enter__(self):
        self.seconds, self.count, self.queued = 0.0, 0, 0.0
        self._original = original = pacer.Pacer.make_room
        self._original_queue = original_queue = pacer.Pacer.queue

        def timed_queue(paced, out, nbytes):
            tic = time.perf_counter()
            original_queue(paced, out, nbytes)
            self.queued += time.perf_counter() - tic

        def timed(paced, nbytes):
            before = len(paced.queued)
            tic = time.perf_counter()
            original(paced, nbytes)
            if len(paced.queued) < before:
                self.seconds += time.perf_counter() - tic
                self.count += 1

        pacer.Pacer.make_room = timed
        pacer.Pacer.queue = timed_queue
        return self

    def __exit__(self, *exc):
        pacer.Pacer.make_room = self._original
        pacer.Pacer.queue = self._original_queue
        return None


def prefill_times(model, rng, chunks: int, chunk: int = 512, host: list | None = None) -> list[float]:
    """Seconds of each of `chunks` prefill chunks (`chunk` rows and the last row's logits, one
    evaluation a chunk) into one cache from context 0. With `host` a list, each chunk also
    appends the host's share: (seconds building its graph, the pacer's waits among them,
    their count, seconds evaluating after the build, seconds handing products to MLX among the
    building's: MLX's encoding)."""
    cache = model.make_cache()
    times = []
    for _ in range(chunks):
        ids = mx.array(rng.integers(0, 1000, size=(1, chunk)), dtype=mx.int32)
        # The pacer timed only when asked: its wrapper is host work at each product.
        with PacerWaits() if host is not None else contextlib.nullcontext() as waits:
            tic = time.perf_counter()
            hidden = model.hidden(ids, cache)
            logits = model.logits(hidden[:, -1:])
            built = time.perf_counter()
            mx.eval(logits)
            done = time.perf_counter()
        times.append(done - tic)
        if host is not None:
            host.append((built - tic, waits.seconds, waits.count, done - built, waits.queued))
    return times


def prefill_figure(model, rng, chunks: int) -> None:
    """512-row prefill chunks into one cache from context 0: tokens/s over all but the first."""
    chunk = 512
    per_chunk = statistics.median(prefill_times(model, rng, chunks, chunk)[1:])
    layer_weights = sum(t.rows * t.row_length for n, t in model.file.tensors.items()
                        if n.startswith("blk.") and len(t.shape) == 2)
    flops = 2 * chunk * layer_weights
    print(f"prefill, {chunk}-row chunks from context 0: {chunk / per_chunk:,.0f} tokens/s "
          f"({1e3 * per_chunk:.1f} ms per chunk, {flops / per_chunk / 1e12:.0f} TFLOP/s in the matmuls; "
          f"{peak_gb()})",
          flush=True)


if __name__ == "__main__":
    main()
