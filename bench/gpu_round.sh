#!/usr/bin/env bash
# The GPU machine's work for a session, in three calls back to back (../shared/device/README.md;
# the machine stays warm ~30 s between calls, and a session has 30 device minutes):
#
#   call 1, carry [".device/a"]:  bash bench/gpu_round.sh start   # wheels' first half copied; llama.cpp's
#                                                                 # CUDA build starts in the background (~280 s)
#   call 2, carry [".device/b"]:  bash bench/gpu_round.sh tests   # wheels installed; make test-gpu alone
#   call 3, no carry:             bash bench/gpu_round.sh bench   # bench/batch.py and llama-batched-bench on
#                                                                 # the same file in the same run
#   (or call 2 with [".device/b"] carried: `bench` installs the wheels itself; PRE_TESTS="pytest
#   args" runs those tests first, NCU_SECONDS=N adds ncu sections of a few products of a 64-row
#   step, BATCH_ARGS more batch.py options, e.g. "--parts --both"; `tests` may follow it)
#   (or call 2/3 `before-after`: issue 44's decode figures of two trees in one call, below)
#   The next round (sessions 48-50, bench/history/session-50.md: no machine in sessions 49 and 50;
#   the forms below are built and tested on the emulator, untimed):
#   1. carry [".device/a"]: bash bench/gpu_round.sh start   (llama.cpp's build starts, ~280 s)
#   2. carry [".device/b"]: the default against each untimed form, llama.cpp beside (the
#      variants are launch settings alone: they run on the default's model, every weight shared;
#      the likeliest first, in case the time runs out):
#        BATCH_SECONDS=500 BATCH_ARGS="--batches 1,8,32,64 --steps 24 --variant
#        tok:tile_stage_by_token=True --variant asplit:batch_attention_splits=128 --variant q4:tile_min_warps=16
#        --variant tokpairs:tile_stage_by_token=True,tile_pairs_from=17
#        --variant tokpairs364:tile_stage_by_token=True,tile_pairs_from=17,tile_threadgroups=364
#        --variant split:tile_glu_split_from=17 --variant one:tile_glu_split_from=17,tile_glu_split_pairs=False"
#        bash bench/gpu_round.sh bench
#      (tokpairs364: pairs hold 3 threadgroups an SM, 396 a wave of 132 SMs; 64-row down and
#      o-projection take 7 chunks of 52 = 364, one wave, where the default's 10 x 52 = 520 is 1.31;
#      asplit: the batched step's attention in 128 / 64 = 2 splits at 64 rows, not 8; q4: 64-row
#      ungated launches bounded to 4 threadgroups an SM, q+gate|k+v's 135 registers capped at 128)
#      (no PRE_TESTS: beside llama.cpp's build the GPU tests crawl)
#   3. TIMELINE_ARGS="--batch 64 --runs 2 --steps 16 --kernels 24 --variant asplit:batch_attention_splits=128"
#      bash bench/gpu_round.sh timeline (64 rows: the wide seams' us a launch against b5bd0c2's
#      26.1 / 21.5; attention_decode's us a launch in 8 splits and in 2), then
#      TESTS_SECONDS=540 bash bench/gpu_round.sh tests
#   With little device time (~250 s): call 1 with LLAMA=0, then, carry [".device/b"],
#   READS_ONLY="gate+up Q4_K,down Q4_K,head Q6_K" READS_ARGS="--rows 64,32 --variant tok:tile_stage_by_token=True
#   --variant tokpairs:tile_stage_by_token=True,tile_pairs_from=17
#   --variant tokpairs364:tile_stage_by_token=True,tile_pairs_from=17,tile_threadgroups=364
#   --variant split:tile_glu_split_from=17 --variant one:tile_glu_split_from=17,tile_glu_split_pairs=False"
#   bash bench/gpu_round.sh reads (bench/tile_read.py: each tile product of Muse Glimmer's shapes
#   beside its loads alone and a plain read, per form; random bytes, no model file).
#   Where a batched step's time goes beside its products (CUPTI kernels a step, gaps):
#     bash bench/gpu_round.sh timeline   (TIMELINE_ARGS: timeline.py's, default --batch 64)
#   Where a product's time goes (stall reasons, occupancy, DRAM rate): NCU_* as above with `ncu`.
#
# What comes back (under $OUT): test-gpu.tgz (every shard's log in one file: a reply brings back a
# few files only), test-gpu.summary, batch.txt, llama-batched.jsonl. Learnt the hard way
# (bench/history/session-37-38.md): the suite beside llama.cpp's build reached a quarter of its
# shards in 200 s; time benches only once the build has ended.
set -uo pipefail
what=${1:?start, tests, bench, reads, check, ncu, timeline or before-after}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

install_wheels() {  # the second half of the wheels (.device/b, carried) joined to the first and installed, once
  [ -d /tmp/site/mlx ] && return 0
  mkdir -p /tmp/w
  cp .device/b/* /tmp/w/ && cat /tmp/w/mlxcuda.part.* > "/tmp/w/$(cat /tmp/w/WHEEL_NAME)" && rm /tmp/w/mlxcuda.part.* \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl
}

pre_tests() {  # PRE_TESTS (pytest's arguments; PRE_K its -k) within PRE_SECONDS; the log's last $1 lines
  timeout "${PRE_SECONDS:-120}" python3 -m pytest -q -p no:cacheprovider $PRE_TESTS ${PRE_K:+-k "$PRE_K"} > "$OUT/pre-tests.txt" 2>&1
  tail -n "$1" "$OUT/pre-tests.txt"
}

write_file() {  # bench/decode.py's full-scale random Muse Glimmer file, once
  [ -f /dev/shm/muse-glimmer-random-52.gguf ] || (cd bench && python3 -c "import numpy as np, decode, pathlib; \
    decode.write_file(pathlib.Path('/dev/shm/muse-glimmer-random-52.gguf'), np.random.default_rng(0))")
}

case "$what" in
start)
  mkdir -p /tmp/w && cp .device/a/* /tmp/w/
  [ "${LLAMA:-1}" = 0 ] || bash .device/a/llamacpp.sh build /tmp/lcpp
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  ;;
tests)
  install_wheels || exit 1
  mkdir -p /tmp/gpulogs
  timeout "${TESTS_SECONDS:-520}" make test-gpu SHARDS="${SHARDS:-16}" GPU_LOGS=/tmp/gpulogs > "$OUT/test-gpu.summary" 2>&1
  echo "make test-gpu exit $?" >> "$OUT/test-gpu.summary"
  tar -czf "$OUT/test-gpu.tgz" -C /tmp gpulogs
  cat /tmp/gpulogs/test-gpu.failed 2>/dev/null | head -40
  tail -n 20 "$OUT/test-gpu.summary"
  ;;
bench)
  # with .device/b carried and the wheels not yet installed (a round without `tests`): install them,
  # and write the file while llama.cpp still builds
  if [ -d .device/b ]; then
    install_wheels || exit 1
  fi
  write_file &  # written while the first tests run
  [ -z "${PRE_TESTS:-}" ] || pre_tests 5  # a few tests first (e.g. a new kernel's), before the benches
  wait
  # NCU_FIRST=1: ncu while llama.cpp still builds (its figures do not depend on the host's load)
  [ -z "${NCU_SECONDS:-}" ] || [ "${NCU_FIRST:-0}" = 0 ] || bash "$0" ncu
  if [ "${LLAMA:-1}" != 0 ]; then  # LLAMA=0: our figures only (a diagnostic round)
    for _ in $(seq 1 300); do [ -f /tmp/lcpp/build.rc ] && break; sleep 1; done
    echo "llama.cpp build: $(cat /tmp/lcpp/build.rc 2>/dev/null || echo 'not done')"
    bin=/tmp/lcpp/llama.cpp/build/bin
    LD_LIBRARY_PATH=$bin timeout 200 "$bin/llama-batched-bench" -m /dev/shm/muse-glimmer-random-52.gguf -ngl 99 -fa 1 \
      -c 20480 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,8,32,64 --output-format jsonl \
      > "$OUT/llama-batched.jsonl" 2> "$OUT/llama-batched.err"
    grep -v '^$' "$OUT/llama-batched.jsonl" | tail -n 4
    tail -n 3 "$OUT/llama-batched.err"
  fi
  timeout "${BATCH_SECONDS:-300}" python3 bench/batch.py --keep --batches 1,8,32,64 --llama-jsonl "$OUT/llama-batched.jsonl" ${BATCH_ARGS:-} 2>&1 | tee "$OUT/batch.txt"
  [ -z "${NCU_SECONDS:-}" ] || [ "${NCU_FIRST:-0}" != 0 ] || bash "$0" ncu
  ;;
reads)  # the shortest useful round (carry .device/b): what bounds each tile product, no model file
  install_wheels || exit 1
  timeout "${READS_SECONDS:-150}" python3 bench/tile_read.py ${READS_ONLY:+--only "$READS_ONLY"} \
    ${READS_ARGS:---rows 8,32,64 --variant int8:tile_half_from=1000 --variant f16:tile_half_from=1} \
    2>&1 | tee "$OUT/tile_read.txt"
  ;;
check)  # the wheels installed (carry .device/b), then PRE_TESTS alone (a short round)
  install_wheels || exit 1
  pre_tests 25
  ;;
ncu)  # a diagnostic: a few products of a step under ncu (NCU_KERNEL, NCU_ARGS: batch.py's options)
  profile() {  # $@: more ncu options
    timeout "$NCU_SECONDS" ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats "$@" \
      -k "regex:${NCU_KERNEL:-product}" --launch-skip "${NCU_SKIP:-400}" --launch-count "${NCU_COUNT:-4}" \
      python3 bench/batch.py --keep --steps 3 ${NCU_ARGS:---batches 64} > "$OUT/ncu${NCU_NAME:-}.txt" 2>&1
  }
  # the stall reasons as metrics (the section prints only its summary); without them if ncu refuses
  profile --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    || grep -q Duration "$OUT/ncu${NCU_NAME:-}.txt" || profile
  grep -E "^  [a-z_]+.*product|Grid Size|Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Block Limit|Stall|stalled|Warp Cycles" "$OUT/ncu${NCU_NAME:-}.txt" | head -120
  ;;
timeline)  # where a batched step's time goes (CUPTI), TIMELINE_ARGS: timeline.py's options
  timeout "${TIMELINE_SECONDS:-200}" python3 bench/timeline.py ${TIMELINE_ARGS:---batch 64 --runs 2 --steps 16 --kernels 24} 2>&1 | tee "$OUT/timeline.txt"
  ;;
before-after)
  # Issue 44's before-and-after: bench/decode.py in a tree of the commit before (carried as
  # .device/before, made here with `mkdir -p .device/before && git archive 10e9c79 | tar -x -C
  # .device/before`) and in this one, on the same file, one after the other (carry .device/b too
  # on a fresh machine). DECODE_ARGS: decode.py's options.
  install_wheels || exit 1
  write_file
  args=${DECODE_ARGS:---keep --contexts 0,8192 --prefill-chunks 6 --repeats 2}
  for tree in .device/before .; do
    name=$([ "$tree" = . ] && echo after || echo before)
    echo "== $name ($tree)"
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout "${DECODE_SECONDS:-250}" python3 bench/decode.py $args) 2>&1 \
      | tee "$OUT/decode-$name.txt"
  done
  ;;
*)
  echo "start, tests, bench, reads, check, ncu, timeline or before-after" >&2
  exit 2
  ;;
esac
