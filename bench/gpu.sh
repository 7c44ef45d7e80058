#!/usr/bin/env bash
# bench/gpu.sh: the project's first NCCL figures in one call, on a CUDA host.
#
#   bash bench/gpu.sh [OUT_DIR]        (default: $OUT when set, else ./bench-gpu-out)
#
# 1. checks that torch sees CUDA and NCCL (else one line on stderr, exit 2);
# 2. `wsync bench --device cuda` on the many (339 tensors), small and medium presets: flattened and
#    per-tensor broadcast over NCCL, colocated (/dev/shm) and disk, each against its floor measured in
#    the same run (end to end and transfer only); writes OUT_DIR/bench.json, bench.png, bench.txt and
#    bench.log, bounded to BENCH_SECONDS (default 280 s, so under 5 minutes);
# 3. the `gpu`-marked tests (`python -m pytest -m gpu`) into OUT_DIR/pytest-gpu.log.
#
# Placement (bench/run.py `placement`): NCCL cannot join two ranks of one group on one GPU, so the server
# gets a GPU of its own: with G >= 3 GPUs, 2 trainer ranks + the server; with G = 2, 1 trainer rank + the
# server; with G = 1 the trainer runs on the GPU, the server on the CPU, and trainer -> server goes over
# gloo (no NCCL broadcast figure: the table's title and bench.json's meta.server_backend say so).
# Exit status: 0 when both steps passed, else the first failing step's.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT_DIR=${1:-${OUT:-bench-gpu-out}}
PY=${PYTHON:-python}
BENCH_SECONDS=${BENCH_SECONDS:-280}
TEST_SECONDS=${TEST_SECONDS:-900}

gpus=$("$PY" - <<'EOF' 2>&1
import sys
try:
    import torch
    import torch.distributed as dist
except Exception as e:  # noqa: BLE001
    sys.exit(f"python cannot import torch ({e})")
if not torch.cuda.is_available():
    sys.exit(f"no CUDA on this host (torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}, "
             f"{torch.cuda.device_count()} GPUs visible); run it on a CUDA host with NCCL")
if not dist.is_nccl_available():
    sys.exit(f"torch {torch.__version__} was built without NCCL; install a CUDA build of torch")
print(torch.cuda.device_count())
EOF
)
if [ $? -ne 0 ]; then
    echo "bench/gpu.sh: $(printf '%s' "$gpus" | tail -n 1)" >&2
    exit 2
fi
gpus=$(printf '%s' "$gpus" | tail -n 1)  # the count is the last line (warnings may come before it)
if [ "$gpus" -ge 3 ]; then nproc=2; else nproc=1; fi

mkdir -p "$OUT_DIR" || exit 2
echo "bench/gpu.sh: $gpus GPU(s), $nproc trainer rank(s); writing $OUT_DIR" >&2
nvidia-smi -L > "$OUT_DIR/gpus.txt" 2>&1 || true

# Each process's CUDA_VISIBLE_DEVICES is set by the bench itself; OMP 1 keeps 16 cores for the ranks.
timeout --signal=TERM --kill-after=15 "$BENCH_SECONDS" \
    "$PY" -m wsync.cli bench --device cuda --nproc "$nproc" --sizes many small medium --repeats 3 \
    --bucket-mb 32 128 512 --timeout 120 --json "$OUT_DIR/bench.json" --plot "$OUT_DIR/bench.png" \
    > "$OUT_DIR/bench.txt" 2> "$OUT_DIR/bench.log"
bench_rc=$?
cat "$OUT_DIR/bench.txt"
[ $bench_rc -eq 0 ] || { echo "bench/gpu.sh: wsync bench exited $bench_rc (124: over ${BENCH_SECONDS} s); its log ends:" >&2
                         tail -n 30 "$OUT_DIR/bench.log" >&2; }

timeout --signal=TERM --kill-after=15 "$TEST_SECONDS" \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider -rA tests > "$OUT_DIR/pytest-gpu.log" 2>&1
test_rc=$?
tail -n 25 "$OUT_DIR/pytest-gpu.log"
[ $test_rc -eq 0 ] || echo "bench/gpu.sh: pytest -m gpu exited $test_rc (5: no gpu test was collected)" >&2

[ $bench_rc -ne 0 ] && exit $bench_rc
exit $test_rc
