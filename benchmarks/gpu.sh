#!/usr/bin/env bash
# relattn on a CUDA machine, in at most 8 minutes: the test suite, then `relattn bench --device cuda`.
# Nothing else needs this script: CI and the CPU workflow (make test, make bench) never call it.
#
#   bash benchmarks/gpu.sh             # results in $OUT if set, else ./gpu-results
#
# Assumes python3 with a CUDA build of torch. It never installs or upgrades torch. Missing pure-Python
# dependencies are installed with pip (pinned by constraints.txt) from benchmarks/wheels/ when that folder
# exists (for machines without an index: fill it here with
#   pip download -d benchmarks/wheels --only-binary=:all: --python-version 3.X tqdm pytest hypothesis \
#       matplotlib ninja 'transformers>=5'
# and carry it), else from the index; relattn itself runs from src/ (PYTHONPATH), not installed, so pip
# never weighs the constraints' CPU torch pin against the CUDA torch already there.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-results}
PY=${PYTHON:-python3}
DEADLINE=$((SECONDS + ${GPU_SH_BUDGET_S:-470}))
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"

log() { echo "[gpu.sh $(date -u +%H:%M:%S) +${SECONDS}s] $*"; }
left() { echo $((DEADLINE - SECONDS)); }

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    log "error: $PY has no torch with CUDA (torch.cuda.is_available() is False); this script does not install torch"
    exit 1
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true

need=()
for mod in numpy matplotlib tqdm pytest hypothesis ninja; do  # ninja: builds the native CPU kernel
    "$PY" -c "import $mod" 2>/dev/null || need+=("$mod")
done
"$PY" -c "import transformers" 2>/dev/null || need+=("transformers>=5")
if ((${#need[@]})); then
    log "installing ${need[*]}"
    src=()
    [[ -d benchmarks/wheels ]] && src=(--no-index --find-links benchmarks/wheels)
    timeout 120 "$PY" -m pip install -q "${src[@]}" -c constraints.txt "${need[@]}" \
        || log "warning: pip could not install all of ${need[*]}; going on with what is there"
fi

status=0
log "tests (CPU and CUDA), at most 200 s"
if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.txt" | tail -25
    rc=${PIPESTATUS[0]}
    log "pytest exit code $rc"
    ((rc == 0)) || status=1
else
    log "error: no pytest, tests not run"
    status=1
fi

bench() {  # bench NAME SECONDS ARGS...: one `relattn bench` run into $OUT/NAME, cut off after SECONDS
    local name=$1 secs=$2
    shift 2
    ((secs > $(left))) && secs=$(left)
    if ((secs < 20)); then
        log "skipping bench $name: out of time"
        status=1
        return
    fi
    log "bench $name (at most ${secs} s): relattn bench --device cuda $*"
    timeout "$secs" "$PY" -m relattn bench --device cuda --no-progress --out "$OUT/$name" "$@"
    local rc=$?
    log "bench $name exit code $rc"
    ((rc == 0)) || status=1
}

LENGTHS=(256 512 1024 2048 4096 8192 16384)
bench bench-cuda 110 --lengths "${LENGTHS[@]}" --repeats 20 --warmup 3 --time-limit 20
bench bench-cuda-causal 90 --causal --lengths "${LENGTHS[@]}" --repeats 20 --warmup 3 --time-limit 20
bench bench-cuda-bf16 60 --dtype bfloat16 --peers --lengths 1024 4096 16384 --repeats 20 --warmup 3 --time-limit 20
bench bench-cuda-memory 40 --memory-check --lengths 16384 32768 65536 --repeats 5

log "done, exit code $status; results in $OUT"
exit $status
