#!/usr/bin/env bash
# bench/gpu_check.sh: what one short GPU lease should bring back, in one call of at most 6 minutes (CHECK_SECONDS).
#
#   bash bench/gpu_check.sh [OUT_DIR]        (default: $OUT when set, else ./gpu-check-out)
#
# Needs .device/ in the repo root (bash scripts/pack_device.sh: wheels of the import dependencies the GPU image
# lacks, and SGLang 0.5.23's and 0.5.6's Python code); carry it along. Every step is bounded by `timeout` and by
# one deadline for the whole script (CHECK_SECONDS, default 360 s), and runs whatever happened before it:
#   0. setup: the wheels into /tmp/site, SGLang's code into /tmp/sglang-cache; torch, CUDA, NCCL, the GPU;
#   1. CUDA IPC between two plain torch processes (python -m bench.cuda_ipc_probe): does this machine allow it?
#   2. the colocated transport's CUDA IPC payload opened by SGLang's own receive code (0.5.23, 0.5.6) in another
#      process, bit-equal (tests/test_cuda_ipc.py::test_cuda_ipc_payload_opens_in_sglang_own_receive_code);
#   3. the bench on CUDA, one call per size so a slow one cannot take the other's figures: many (339 tensors)
#      then medium (193 M); one GPU: the trainer on it, the server on the CPU over gloo (bench/run.py placement);
#   4. the other `gpu`-marked tests (the tiny CUDA bench of tests/test_bench.py; real-SGLang tests skip);
#   5. summary.txt: each step's exit status and key numbers.
# Files in OUT_DIR (7; a lease brings back at most 8): summary.txt setup.log pytest-gpu.log bench.txt bench.log
# bench-many.json bench-medium.json. Exit status: 0 when every step passed, else 1.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT_DIR=${1:-${OUT:-gpu-check-out}}
PY=${PYTHON:-python3}
DEVICE_DIR=${DEVICE_DIR:-.device}
CHECK_SECONDS=${CHECK_SECONDS:-360}
STEPS=" ${GPU_CHECK_STEPS:-0 1 2 3 4} "  # which steps run (setup, 0, always runs): a rerun may take fewer
START=$(date +%s)
mkdir -p "$OUT_DIR" || exit 2
SUMMARY="$OUT_DIR/summary.txt"
SETUP="$OUT_DIR/setup.log"
: > "$SUMMARY"
: > "$SETUP"
failed=0

left() { echo $(( CHECK_SECONDS - ($(date +%s) - START) )); }

# step NAME BUDGET_S CMD...: runs CMD under `timeout min(BUDGET, time left)`; records its status and seconds.
step() {
    local name=$1 budget=$2 rest t0 rc
    shift 2
    rest=$(left)
    [ "$rest" -lt "$budget" ] && budget=$rest
    if [ "$budget" -lt 20 ]; then
        echo "$name: skipped (${rest} s left of CHECK_SECONDS=${CHECK_SECONDS})" | tee -a "$SUMMARY"
        failed=1
        return 0
    fi
    t0=$(date +%s)
    # through bash -c, so that CMD may be a function of this script (exported with export -f)
    timeout --signal=TERM --kill-after=10 "$budget" bash -c '"$@"' bash "$@"
    rc=$?
    [ $rc -eq 0 ] || failed=1
    local what="exit $rc"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="exit $rc (over its ${budget} s)"
    echo "$name: $what, $(( $(date +%s) - t0 )) s" | tee -a "$SUMMARY"
}

# ---- 0. setup
setup() {
    local whl=("$DEVICE_DIR"/whl/*.whl)
    [ -e "${whl[0]}" ] || { echo "no wheels in $DEVICE_DIR/whl (bash scripts/pack_device.sh; carry .device)"; return 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${whl[@]}" 2>&1 | grep -v "neither a file nor a directory" || true
    mkdir -p /tmp/sglang-cache || return 1
    tar -xJf "$DEVICE_DIR/sglang-code.tar.xz" -C /tmp/sglang-cache 2>/dev/null \
        || "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
            "$DEVICE_DIR/sglang-code.tar.xz" /tmp/sglang-cache || return 1  # without an xz binary
    ls -d /tmp/sglang-cache/sglang-*
    nvidia-smi -L 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$PY" - <<'EOF'
import torch, torch.distributed as dist
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available {torch.cuda.is_available()}, "
      f"{torch.cuda.device_count()} GPU(s), NCCL available {dist.is_nccl_available()}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU 0: {p.name}, capability {p.major}.{p.minor}, {p.total_memory >> 20} MiB, uuid {p.uuid}")
import transformers, safetensors
print("transformers", transformers.__version__, "safetensors", safetensors.__version__)
import fastapi, pydantic, tensordict, uvicorn  # the carried wheels
print("fastapi", fastapi.__version__, "pydantic", pydantic.__version__, "tensordict", tensordict.__version__,
      "uvicorn", uvicorn.__version__)
EOF
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || { echo "no CUDA here"; return 3; }
}
export -f setup
export PY DEVICE_DIR PYTHONPATH="/tmp/site:$PWD" WSYNC_SGLANG_CACHE=/tmp/sglang-cache PYTHONUNBUFFERED=1
{ echo "== setup ($(date -u +%FT%TZ), $(nproc) CPUs, $(uname -m))"; } >> "$SETUP"
step "0 setup (wheels, SGLang code, versions)" 90 setup >> "$SETUP" 2>&1
grep -E "^(torch|GPU 0|transformers|fastapi)" "$SETUP" >> "$SUMMARY"
sed -n '/^0 setup/p' "$SUMMARY" >&2

want() { [[ "$STEPS" == *" $1 "* ]]; }

# ---- 1. CUDA IPC with plain torch; device-to-host copies into pageable and pinned memory
if want 1; then
echo "== 1. CUDA IPC between two torch processes" >> "$SETUP"
step "1 torch CUDA IPC probe" 60 "$PY" -m bench.cuda_ipc_probe >> "$SETUP" 2>&1
grep "^cuda_ipc_probe" "$SETUP" >> "$SUMMARY"
step "1 device-to-host copy, pageable vs pinned" 40 "$PY" -c '
import time, torch
src = [torch.randn(8 << 20, device="cuda").to(torch.bfloat16) for _ in range(12)]  # 12 x 16 MiB
for pinned in (False, True, False, True):
    dst = torch.empty(16 << 20, dtype=torch.uint8, pin_memory=pinned)
    torch.cuda.synchronize(); t = time.perf_counter()
    for s in src:
        dst.view(torch.bfloat16).copy_(s)
    dt = time.perf_counter() - t
    kind = "pinned  " if pinned else "pageable"
    print(f"d2h {kind} 12 x 16 MiB: {dt * 1e3:.1f} ms, {12 * 16 * 2**20 / dt / 1e9:.1f} GB/s")
rt = torch.cuda.cudart()
for _ in range(2):  # pageable memory registered for the copies (as an mmap of /dev/shm would be)
    dst = torch.empty(16 << 20, dtype=torch.uint8)
    torch.cuda.synchronize(); t = time.perf_counter()
    rt.cudaHostRegister(dst.data_ptr(), dst.numel(), 0)
    t1 = time.perf_counter()
    for s in src:
        dst.view(torch.bfloat16).copy_(s)
    rt.cudaHostUnregister(dst.data_ptr())
    dt = time.perf_counter() - t
    print(f"d2h registered 12 x 16 MiB: {dt * 1e3:.1f} ms incl. register {(t1 - t) * 1e3:.1f} ms")
' >> "$SUMMARY" 2>&1
fi

# ---- 2. the payload through SGLang's own receive code
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rA --timeout 200)
if want 2; then
echo "== 2. CUDA IPC payload into SGLang's own receive code" > "$OUT_DIR/pytest-gpu.log"
step "2 CUDA IPC payload, SGLang's receive code (pytest)" 170 \
    "${PYTEST[@]}" -m gpu "tests/test_cuda_ipc.py::test_cuda_ipc_payload_opens_in_sglang_own_receive_code" \
    >> "$OUT_DIR/pytest-gpu.log" 2>&1
grep -E "^CUDA_IPC_REPORT|^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" "$OUT_DIR/pytest-gpu.log" \
    | cut -c1-600 >> "$SUMMARY"
fi

# ---- 3. the bench, one size per call
if want 3; then
: > "$OUT_DIR/bench.txt"
: > "$OUT_DIR/bench.log"
for spec in ${GPU_CHECK_BENCH:-many:75 medium:140}; do  # size:seconds
    set -- ${spec/:/ }
    echo "== wsync bench --sizes $1" | tee -a "$OUT_DIR/bench.txt" >> "$OUT_DIR/bench.log"
    step "3 bench $1 (cuda, buckets 32 512 MiB, 2 repeats)" "$2" \
        "$PY" -m wsync.cli bench --device cuda --nproc 1 --sizes "$1" --repeats 2 --bucket-mb 32 512 --no-etcd \
        --timeout 60 --json "$OUT_DIR/bench-$1.json" >> "$OUT_DIR/bench.txt" 2>> "$OUT_DIR/bench.log"
done
"$PY" - "$OUT_DIR" >> "$SUMMARY" 2>&1 <<'EOF'
import json, os, sys
for size in ("many", "medium"):
    path = os.path.join(sys.argv[1], f"bench-{size}.json")
    if not os.path.exists(path):
        print(f"bench {size}: no results")
        continue
    r = json.load(open(path))
    m = r["meta"]
    print(f"bench {size}: {m['seconds']:.0f} s, device {m['device']}, trainer->server {m['server_backend']}, "
          f"GPUs {m['gpus']}, failed {r['failed'] or '-'}")
    for row in r["rows"]:
        x = (row.get("transfer_seconds") or {}).get("median")
        print(f"  {row['method']:34} median {row['seconds']['median']:.3f} s  {row['gbps']:6.2f} GB/s"
              + (f"  ratio {row['ratio']:.2f}" if row.get("ratio") is not None else "")
              + (f"  xfer {x:.3f} s" if x is not None else ""))
    for t in r["targets"]:
        print(f"  [{ {True: 'met', False: 'MISSED'}.get(t['met'], 'n/a') }] {t['target']}: {t['measured']}")
EOF
fi

# ---- 4. the other gpu tests
if want 4; then
echo "== 4. the other gpu-marked tests" >> "$OUT_DIR/pytest-gpu.log"
step "4 other gpu tests (pytest -m gpu)" 120 "${PYTEST[@]}" -m gpu tests \
    --deselect "tests/test_cuda_ipc.py::test_cuda_ipc_payload_opens_in_sglang_own_receive_code" \
    >> "$OUT_DIR/pytest-gpu.log" 2>&1
tail -n 12 "$OUT_DIR/pytest-gpu.log" | grep -E "passed|failed|skipped|error" >> "$SUMMARY"
fi

echo "total $(( $(date +%s) - START )) s; $([ $failed -eq 0 ] && echo 'every step passed' || echo 'a step failed or was skipped')" \
    >> "$SUMMARY"
cat "$SUMMARY"
exit $failed
