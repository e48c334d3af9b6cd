"""A timeline of pipelined Muse Glimmer decode steps on a CUDA GPU: where the GPU waits.

The H200 machine has no nsys; PyTorch's profiler (CUPTI, process-wide) records every kernel
the process runs, MLX's included, with the host's own marks on the same clock. This script
loads the full-scale file bench/decode.py writes (kept there with --keep, else written here),
runs generate()'s pipelined loop (decode.py's pipelined_decode_ms) --runs times under the
profiler, and prints per run:
- ms per step (host wall clock) and the GPU's busy time per step (the union of its kernels),
  so a step that is slow with an idle GPU shows as busy << wall;
- the gaps between consecutive kernels: their sum per step, how many exceed 5 / 20 / 100 us,
  and the largest, with the kernels on either side;
- the host's marks per step: building the graph, queuing it (async_eval), waiting (eval).
Then the kernels' time per step by name, over all runs.

    python bench/timeline.py [--dir /dev/shm] [--steps 20] [--runs 4] [--context 0]
                             [--trace out.json.gz] [--set field=value ...] [--batch B --prompt P]
                             [--variant NAME:field=value,... ...]

--prefill N profiles N 512-row prefill chunks instead (kernel_times.py prefill's measure): the
GPU's busy time on all streams and on each, and the kernels by time; each --variant
NAME:field=value,... is profiled again with those settings.

It first prints the copy bandwidth of the same process (decode.py's measure), the ceiling the
kernels' figures are read against, then the same copy's bandwidth in GPU time (CUPTI, one 1 GiB
launch), as the kernels are timed. --copy-sizes 15.34,34.29,... also times, under the profiler,
copies (`x + 1` over float32) that move each of those many MB (read + write) as one launch: the
kernel time (CUPTI) of a copy the size of a product, against the 4 GiB one; and a plain read of
that many MB as one launch (READ_KERNEL: 16-byte loads, four in flight a thread; the fastest of
a few grids), the least a product of that many bytes could take. Both rotate through buffers of
256 MB or more in all, so none reads from L2 what the one before it left there.

Each --variant NAME:field=value,... of a decode profile is profiled again (the model rebuilt
with those settings over the same file, its step traced again), after the default. A variant's
short products read slow: the o-projection took 6.95-7.05 µs as a variant and 6.15-6.21 as the
default in the same process, whichever configuration was which. Compare the short products as
defaults (--set), one process each.

--batch B profiles B sequences' batched decode steps instead (bench/batch.py's run_batch: a
--prompt-position prompt each, --steps steps pipelined as BatchGenerator.next(); the store's
filling and 3 warm-up steps are left out of the figures by a mark): per run the GPU's busy
time, gaps and kernels a step, then the kernels by time (each --variant again): where a batched
step's time goes beside its products.

--set loads the model with those muser_mlx.settings.Settings (bench/settings_cli.py), e.g.
`--set attention_head_group=1`.

Needs torch (the H200 machine has it; it is not a dependency of muser_mlx).
"""

from __future__ import annotations

import argparse
import collections
import gc
import gzip
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as bench_decode  # noqa: E402
from kernel_times import prefill_chunk  # noqa: E402
from muser_mlx.generate import load  # noqa: E402
from settings_cli import HELP, parse_variant, rebuilt, settings_from  # noqa: E402


def profiled_run(model, cache, steps: int):
    """generate()'s loop (decode.py's pipelined_decode_ms, with the profiler's marks of each
    step's build, queue and wait) under the profiler; returns its ms per step and the trace
    events."""
    import torch.profiler as tp

    with tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA]) as prof:
        ms = bench_decode.pipelined_decode_ms(bench_decode.fused_step, model, cache, steps,
                                              mark=tp.record_function)
    return ms, trace_events(prof)


def trace_events(prof) -> list:
    """A finished profile's events, through the Chrome trace it exports."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        name = f.name
    prof.export_chrome_trace(name)
    events = json.loads(Path(name).read_text())["traceEvents"]
    os.unlink(name)
    return events


def union(kernels) -> tuple[float, list]:
    """The kernels' busy time (the union of their [ts, ts + dur) intervals, us) and the gaps
    between them: (gap us, kernel before, kernel after)."""
    kernels = sorted(kernels, key=lambda e: e["ts"])
    busy, gaps, end = 0.0, [], None
    for a, b in zip(kernels, kernels[1:] + [None]):
        start, stop = a["ts"], a["ts"] + a["dur"]
        if end is None or start >= end:
            busy += a["dur"]
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
        if b is not None and b["ts"] > end:
            gaps.append((b["ts"] - end, a["name"], b["name"]))
    return busy, gaps


def summarize(events) -> dict:
    """The kernels' busy time (union of their intervals), span, gaps between them (with the
    kernels on either side), and the host marks' median durations by kind."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])
    marks = [e for e in events if e.get("cat") == "user_annotation" and "dur" in e]
    if not kernels:
        return {"kernels": 0}
    busy, gaps = union(kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    host = collections.defaultdict(list)
    for m in marks:
        host[m["name"].split(" ")[0]].append(m["dur"])
    return {
        "kernels": len(kernels), "steps": max(1, sum("argmax" in k["name"] for k in kernels)), "span_us": span, "busy_us": busy, "gaps": gaps,
        "host": {k: statistics.median(v) for k, v in host.items()},
        "names": [(k["name"], k["dur"]) for k in kernels],
    }


# A plain read of WORDS 16-byte words (Metal text; CUDA through muser_mlx.kernels.to_cuda):
# thread i of T reads words i, i + T, i + 2T, i + 3T, ... four loads in flight, and stores only
# if their XOR is a value it practically never is (so the loads cannot be dropped).
READ_KERNEL = """
const device uint4* words = (const device uint4*)data;
uint step = threadgroups_per_grid.x * threads_per_threadgroup.x;
uint acc = 0u;
for (uint i = thread_position_in_grid.x; i < uint(WORDS); i += 4u * step) {
  uint4 a = words[i];
  uint4 b = words[min(i + step, uint(WORDS) - 1u)];
  uint4 c = words[min(i + 2u * step, uint(WORDS) - 1u)];
  uint4 d = words[min(i + 3u * step, uint(WORDS) - 1u)];
  acc ^= (a.x ^ b.y ^ c.z ^ d.w) ^ (a.y ^ b.z ^ c.w ^ d.x) ^ (a.z ^ b.w ^ c.x ^ d.y) ^ (a.w ^ b.x ^ c.y ^ d.z);
}
if (acc == 0x9E3779B9u) {
  out[0] = acc;
}
"""


def read_kernel():
    from muser_mlx import kernels

    if kernels.backend() == "metal":
        return mx.fast.metal_kernel(name="read_ceiling", input_names=["data"], output_names=["out"],
                                    source=READ_KERNEL)
    return mx.fast.cuda_kernel(name="read_ceiling", input_names=["data"], output_names=["out"],
                               source=kernels.to_cuda(READ_KERNEL), header=kernels.CUDA_PRELUDE)


def timed_launches(launch, arrays, rounds: int = 3) -> list:
    """CUPTI durations (us) of launch(a) for each array, `rounds` times over (one evaluation
    each, after one unprofiled round): those of the kernel launched most often."""
    import torch.profiler as tp

    for a in arrays:
        mx.eval(launch(a))
    with tp.profile(activities=[tp.ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            for a in arrays:
                mx.eval(launch(a))
    groups = collections.defaultdict(list)
    for e in trace_events(prof):
        if e.get("cat") == "kernel" and "dur" in e:
            groups[e["name"]].append(e["dur"])
    durations = max(groups.values(), key=len) if groups else []
    return durations if len(durations) >= rounds * len(arrays) else []


def copy_launches(nbytes: int) -> tuple[int, list]:
    """One `x + 1` launch (float32) moving about `nbytes` (read + write), over rotating buffers
    of 256 MB or more in all (past the H200's 50 MB L2): (bytes moved a launch, CUPTI
    durations in us, empty if the profiler missed a launch)."""
    n = nbytes // 8  # float32 values: 4 bytes read + 4 written each
    xs = [mx.random.normal((n,)) for _ in range(max(4, -(-256 * 10**6 // (8 * n))))]
    mx.eval(xs)
    durations = timed_launches(lambda x: x + 1.0, xs)
    del xs
    mx.clear_cache()
    return 8 * n, durations


def gpu_copy_bandwidth() -> None:
    """Prints the copy's bandwidth in GPU time (CUPTI), as the kernels are timed: one 1 GiB
    `x + 1` launch (read + write) over 4 rotating buffers. The host-timed 4 GiB figure includes
    a launch's host latency: it moved 3.10-3.65 TB/s on leases where this gave 3.81."""
    moved, durations = copy_launches(1 << 30)
    if durations:
        print(f"copy bandwidth in GPU time (1 GiB elementwise, read+write, CUPTI median of {len(durations)}): "
              f"{moved / statistics.median(durations) / 1e6:.2f} TB/s", flush=True)


def copy_sizes_profile(sizes_mb: list[float], bandwidth: float) -> None:
    """--copy-sizes: per size, the median CUPTI time of one copy launch moving that many MB
    (copy_launches) and of one READ_KERNEL launch reading them (the fastest of four grids, each
    printed), over rotating buffers of 256 MB or more, and their bandwidth against the 4 GiB
    copy's."""
    kernel = read_kernel()

    def report(what: str, nbytes: int, durations: list) -> None:
        if not durations:
            print(f"{what}: the profiler did not see every launch")
            return
        us = statistics.median(durations)
        print(f"{what} (one launch, {len(durations)} timed): {us:.2f} us, {nbytes / us / 1e6:.2f} TB/s = "
              f"{100 * nbytes / us / 1e6 / (bandwidth / 1e12):.1f} % of the 4 GiB copy", flush=True)

    for mb in sizes_mb:
        report(f"copy of {mb:g} MB", *copy_launches(int(mb * 1e6)))
        words = int(mb * 1e6) // 16
        count = max(4, -(-256 * 10**6 // (16 * words)))  # 256 MB or more in all, as the copies
        data = [mx.random.normal((4 * words,)).view(mx.uint32) for _ in range(count)]
        mx.eval(data)
        best = None
        for per_sm, threads in ((4, 256), (8, 256), (16, 128), (2, 1024)):
            blocks = 132 * per_sm  # the H200's SMs

            def launch(a, blocks=blocks, threads=threads):
                return kernel(inputs=[a], template=[("WORDS", words)], grid=(blocks * threads, 1, 1),
                              threadgroup=(threads, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.uint32])[0]

            durations = timed_launches(launch, data)
            us = statistics.median(durations) if durations else float("nan")
            print(f"  read of {mb:g} MB, grid {blocks} x {threads}: {us:.2f} us")
            if durations and (best is None or us < best[0]):
                best = (us, f"{blocks} x {threads}", durations)
        if best:
            report(f"read of {mb:g} MB, grid {best[1]}", 16 * words, best[2])
        del data
        mx.clear_cache()


def short_name(name: str) -> str:
    """A kernel's name without MLX's namespace and its arguments."""
    return name.split("(")[0].replace("mlx::core::cu::custom_kernel_muser_", "")[:70]


def prefill_profile(args, model, rng, label: str) -> None:
    """--prefill N: N 512-row chunks from context 0 (kernel_times.py prefill's measure: the
    hidden states and the last row's logits) under the profiler, after one unprofiled chunk.
    Prints ms per chunk, then per chunk: the GPU's busy time (all streams), each stream's
    busy time (their sum over the union shows how much ran at once), and the kernels by time."""
    import torch.profiler as tp

    prefill_chunk(model, rng)
    with tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA]) as prof:
        times = [1e3 * prefill_chunk(model, rng) for _ in range(args.prefill)]
    events = trace_events(prof)
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    n = args.prefill
    print(f"prefill {label}: {[round(t, 1) for t in times]} ms per 512-row chunk "
          f"({512e3 / statistics.median(times):,.0f} tokens/s)")
    if not kernels:
        print("  the profiler recorded no kernel")
        return
    streams = collections.defaultdict(list)
    for k in kernels:
        streams[k.get("args", {}).get("stream", k.get("tid"))].append(k)
    per_stream = {s: union(ks)[0] / n / 1e3 for s, ks in streams.items()}
    print(f"  GPU busy {union(kernels)[0] / n / 1e3:.2f} ms a chunk (all streams); by stream (ms): "
          f"{ {s: round(v, 2) for s, v in per_stream.items()} }; kernels {len(kernels) / n:.0f} a chunk")
    by_name = collections.defaultdict(lambda: [0.0, 0, set()])
    for s, ks in streams.items():
        for k in ks:
            entry = by_name[short_name(k["name"])]
            entry[0] += k["dur"]
            entry[1] += 1
            entry[2].add(s)
    for name, (dur, count, where) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.kernels]:
        print(f"  {dur / n / 1e3:7.2f} ms  {count / n:6.1f} x  stream {sorted(where)}  {name}")
    ordered = sorted(kernels, key=lambda k: k["ts"])
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(ordered, ordered[1:])]
    gaps = [g for g in gaps if g > 0]
    print(f"  gaps between kernels: {sum(gaps) / n / 1e3:.2f} ms a chunk; over 5 / 20 / 100 us: "
          f"{sum(g > 5 for g in gaps) / n:.0f} / {sum(g > 20 for g in gaps) / n:.0f} / "
          f"{sum(g > 100 for g in gaps) / n:.0f} a chunk")
    if args.sequence:  # the last chunk's kernels in order, from its middle: one layer's launches
        last = ordered[-len(ordered) // n:]
        middle = len(last) // 2
        print(f"  the last chunk's kernels {middle}-{middle + args.sequence} in order (us, gap before):")
        for a, b in zip(last[middle - 1:], last[middle:middle + args.sequence]):
            print(f"    {b['dur']:8.1f} {b['ts'] - a['ts'] - a['dur']:8.1f}  {short_name(b['name'])}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--context", type=int, default=0)
    parser.add_argument("--trace", help="also write the last run's kernels and marks here (.json.gz)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help=f"load the model with these settings: {HELP}")
    parser.add_argument("--prefill", type=int, default=0,
                        help="profile this many 512-row prefill chunks instead of decode steps")
    parser.add_argument("--variant", action="append", default=[],
                        metavar="NAME:FIELD=VALUE,...",
                        help="profiled again with the model rebuilt with these settings")
    parser.add_argument("--kernels", type=int, default=14,
                        help="--prefill, --batch: print this many kernel names by time")
    parser.add_argument("--sequence", type=int, default=0,
                        help="--prefill: print this many of the last chunk's kernels in order, from its middle")
    parser.add_argument("--batch", type=int, default=0,
                        help="profile B sequences' batched decode steps instead of generate()'s step")
    parser.add_argument("--prompt", type=int, default=128, help="--batch: each sequence's prompt length")
    parser.add_argument("--copy-sizes", default="",
                        help="MB,MB,...: also time one-launch copies moving that many MB (read + write)")
    args = parser.parse_args()
    settings = settings_from(args.set)
    variants = [("", [], settings)]
    for variant in args.variant:
        name, changes = parse_variant(variant)
        variants.append((name, changes, settings_from(changes, settings)))
    if args.set:
        print(f"settings: {args.set}")
    # The copy ceiling of this process, for the kernels' % of it (RESULTS.md tables): the
    # issue's figures want the same run's, and a lease's copy moves 3.10-3.65 TB/s.
    bandwidth = bench_decode.copy_bandwidth(4 << 30)
    print(f"copy bandwidth (4 GiB elementwise, read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    gpu_copy_bandwidth()
    if args.copy_sizes:
        copy_sizes_profile([float(v) for v in args.copy_sizes.split(",")], bandwidth)
    path = Path(args.dir) / "muse-glimmer-random-52.gguf"
    rng = np.random.default_rng(0)
    if not path.exists() or path.stat().st_size < bench_decode.ARTIFACT_BYTES * 0.9:
        bench_decode.write_file(path, rng)
    model, _ = load(path, settings=settings)
    for tensor in model.file.tensors.values():
        mx.eval(tensor.data)
    if args.prefill:
        for label, changes, variant_settings in variants:
            model = rebuilt(model, variant_settings)
            gc.collect()  # the model replaced (and its stacked projections) freed
            prefill_profile(args, model, rng, f"{label} {changes}" if label else str(args.set))
        return
    if args.batch:
        profile = lambda model: batch_profile(args, model, rng)  # noqa: E731
    else:
        cache = model.make_cache()
        bench_decode.fill_context(model, cache, args.context, rng)
        profile = lambda model: decode_profile(args, model, cache)  # noqa: E731
    for label, changes, variant_settings in variants:
        model = rebuilt(model, variant_settings)
        gc.collect()
        if label:
            print(f"variant {label}: {changes}")
        profile(model)


class KernelTally:
    """The kernels of profiled runs by name: GPU time and launches, per step."""

    def __init__(self):
        self.by_name = collections.defaultdict(float)
        self.launches = collections.Counter()
        self.steps = 0

    def add(self, summary: dict, steps: int) -> None:
        for name, dur in summary["names"]:
            self.by_name[name] += dur
            self.launches[name] += 1
        self.steps += steps

    def print(self, count: int) -> None:
        if not self.steps:
            return
        print("kernels by GPU time a step (us a step, launches a step, us a launch):")
        for name, dur in sorted(self.by_name.items(), key=lambda kv: -kv[1])[:count]:
            print(f"  {dur / self.steps:8.1f}  {self.launches[name] / self.steps:5.1f} x "
                  f"{dur / self.launches[name]:7.2f}  {name[:90]}")


TIMED_MARK = "muser_timed_steps"


def timed_steps(events: list) -> list:
    """The events from run_batch's timed steps on: its setup (the store filled: MLX's copies,
    which session 48's timeline counted as the steps') and warm-up steps end in a wait before the
    mark begins, so every kernel that starts after the mark's start is a timed step's."""
    marks = [e["ts"] for e in events if e.get("name") == TIMED_MARK and "ts" in e]
    if not marks:
        return events
    return [e for e in events if e.get("cat") != "kernel" or e.get("ts", 0) >= min(marks)]


def batch_profile(args, model, rng) -> None:
    """--runs profiled runs of --steps batched steps of --batch sequences (bench/batch.py's
    run_batch, after one unprofiled run): per run its wall ms a step, the GPU's busy time, gaps
    and kernels a step; then the kernels' time a step by name."""
    import torch.profiler as tp

    import batch as bench_batch
    from muser_mlx.generate import feed
    from muser_mlx.models import cpu_decode

    prompt_cache = cpu_decode.generation_cache(model)
    feed(model, rng.integers(0, model.config.vocab, size=args.prompt).tolist(), prompt_cache)
    bench_batch.run_batch(model, prompt_cache, args.batch, args.prompt, args.steps, rng)  # compile, warm
    tally = KernelTally()
    for run in range(args.runs):
        with tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA]) as prof:
            seconds = bench_batch.run_batch(model, prompt_cache, args.batch, args.prompt, args.steps, rng,
                                            timed=lambda: tp.record_function(TIMED_MARK))
        s = summarize(timed_steps(trace_events(prof)))
        if not s["kernels"]:
            print(f"run {run}: the profiler recorded no kernel (CUPTI saw none of MLX's)")
            continue
        n = args.steps
        sizes = sorted((g[0] for g in s["gaps"]), reverse=True)
        print(f"run {run}: B = {args.batch}, {1e3 * seconds / args.steps:.2f} ms/step (wall, timed steps); GPU: "
              f"{s['kernels'] / n:.0f} kernels, busy {s['busy_us'] / n / 1e3:.2f} ms a step; gaps "
              f"{sum(sizes) / n / 1e3:.2f} ms a step, {sum(g > 5 for g in sizes) / n:.1f} > 5 us, "
              f"{sum(g > 20 for g in sizes) / n:.1f} > 20 us a step", flush=True)
        tally.add(s, n)
    tally.print(args.kernels)


def decode_profile(args, model, cache) -> None:
    """--runs profiled runs of --steps pipelined decode steps (after an unprofiled one that
    compiles the step): per run the step's time, GPU busy time and gaps; then the kernels' time
    a step by name."""
    bench_decode.pipelined_decode_ms(bench_decode.fused_step, model, cache, args.steps)  # compile, warm
    tally = KernelTally()
    for run in range(args.runs):
        ms, events = profiled_run(model, cache, args.steps)
        s = summarize(events)
        if not s["kernels"]:
            print(f"run {run}: {ms:.2f} ms/step; the profiler recorded no kernel (CUPTI saw none of MLX's)")
            continue
        n = s["steps"]  # the profile's steps, each ending in the greedy argmax
        gaps = sorted(s["gaps"], reverse=True)
        sizes = [g[0] for g in gaps]
        print(f"run {run}: {ms:.2f} ms/step (host median); GPU: {s['kernels'] / n:.0f} kernels, "
              f"busy {s['busy_us'] / n / 1e3:.2f} ms and span {s['span_us'] / n / 1e3:.2f} ms a step; "
              f"gaps {sum(sizes) / n / 1e3:.2f} ms a step, "
              f"{sum(g > 5 for g in sizes) / n:.1f} > 5 us, {sum(g > 20 for g in sizes) / n:.1f} > 20 us, "
              f"{sum(g > 100 for g in sizes) / n:.2f} > 100 us a step; host marks (median us): "
              f"{ {k: round(v) for k, v in s['host'].items()} }", flush=True)
        for size, before, after in gaps[:4]:
            print(f"    gap {size:7.1f} us: {before[:50]} -> {after[:50]}")
        tally.add(s, n)
        if args.trace and run == args.runs - 1:
            keep = [e for e in events if e.get("cat") in ("kernel", "user_annotation")]
            with gzip.open(args.trace, "wt") as f:
                json.dump(keep, f)
    tally.print(20)


if __name__ == "__main__":
    main()
