#!/usr/bin/env bash
# relattn's "triton" backend on a CUDA machine, in at most 8 minutes: `relattn check` (device, versions, auto's choices,
# every backend against the float64 formula, one timed call each; a wrong answer fails the run); its CUDA tests; the
# compile table for this GPU's
# architecture (benchmarks/triton_compile.py: registers and spills of every launch); `relattn bench --device cuda` in
# bfloat16 (forward and forward+backward, N = 1k ... 32k, K = 64, D = 64 and 128, causal and not) against SDPA
# (FlashAttention-2 inside PyTorch); peers at N = 4096 and 8192 with TFLOP/s beside every ratio: triton, SDPA-flash
# and FlexAttention doing only the key term (a score_mod reading QA = q a^K^T), forward and forward+backward, and
# at D = 64 non-causal triton with the key and position-to-content terms (rel_q, DeBERTa's shape); then
# decoding: one query against 32k cached keys, triton vs SDPA.
# Nothing else needs this script: CI and the CPU workflow (make test, make bench) never call it.
#
#   bash benchmarks/gpu.sh             # results in $OUT if set, else ./gpu-results
#
# Assumes python3 with a CUDA build of torch; it never installs or upgrades torch. Missing pure-Python
# dependencies (and triton, at the version torch asks for, when torch came without it) are installed with pip
# from benchmarks/wheels/ when that folder exists (a machine without an index), else from the index. relattn
# runs from src/ (PYTHONPATH), not installed. Results: gpu.log, check.txt, pytest.txt, compile.txt, bench-*/bench.{json,png},
# peers.json, decode.json and decode.png.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-results}
PY=${PYTHON:-python3}
DEADLINE=$((SECONDS + ${GPU_SH_BUDGET_S:-460}))
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels (tests/conftest.py sets it only where there is no CUDA)

log() { echo "[gpu.sh $(date -u +%H:%M:%S) +${SECONDS}s] $*"; }
left() { echo $((DEADLINE - SECONDS)); }

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    log "error: $PY has no torch with CUDA (torch.cuda.is_available() is False); this script does not install torch"
    exit 1
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true

need=()
for mod in numpy matplotlib tqdm pytest hypothesis; do
    "$PY" -c "import $mod" 2>/dev/null || need+=("$mod")
done
"$PY" -c "import transformers" 2>/dev/null || need+=("transformers>=5")
"$PY" -c "import xdist" 2>/dev/null || need+=(pytest-xdist)  # the tests compile ~60 kernels: 8 processes
if ! "$PY" -c "import triton" 2>/dev/null; then  # the triton torch was built against, else any
    need+=("$("$PY" -c "import importlib.metadata as m
print(next((r.split(';')[0].replace(' ', '') for r in (m.requires('torch') or []) if r.startswith('triton')),
           'triton'))")")
fi
if ((${#need[@]})); then
    log "installing ${need[*]}"
    src=()
    [[ -d benchmarks/wheels ]] && src=(--no-index --find-links benchmarks/wheels)
    timeout 120 "$PY" -m pip install -q "${src[@]}" -c constraints.txt "${need[@]}" \
        || log "warning: pip could not install all of ${need[*]}; going on with what is there"
fi
"$PY" -c "import triton; print('triton', triton.__version__)" || { log "error: no triton"; exit 1; }

status=0
log "relattn check (at most 90 s)"
timeout 90 "$PY" -m relattn check 2>&1 | tee "$OUT/check.txt"
rc=${PIPESTATUS[0]}
log "relattn check exit code $rc"
((rc == 0)) || status=1

log "CUDA tests of the triton backend (compiled), at most 120 s"
par=()
"$PY" -c "import xdist" 2>/dev/null && par=(-n 8)
timeout 120 "$PY" -m pytest -q -p no:cacheprovider -rs "${par[@]}" tests/backends/test_triton.py 2>&1 \
    | tee "$OUT/pytest.txt" | tail -25
rc=${PIPESTATUS[0]}
log "pytest exit code $rc"
((rc == 0)) || status=1

# the compile table for this GPU's own arch, when the triton backend serves it (relattn.backends.triton.CUDA_ARCHS)
arch=$("$PY" -c "import torch; major, minor = torch.cuda.get_device_capability(); print(10 * major + minor)")
if "$PY" -c "import sys; from relattn.backends import triton as t; sys.exit(0 if $arch in dict(t.CUDA_ARCHS) else 1)"; then
    log "compile table for sm_$arch, its CI shapes (benchmarks/triton_compile.py --ci --arch $arch), at most 90 s"
    timeout 90 "$PY" benchmarks/triton_compile.py --ci --arch "$arch" 2>&1 | grep -v -i warn | tee "$OUT/compile.txt"
    rc=${PIPESTATUS[0]}
    log "compile table exit code $rc"
    ((rc == 0)) || status=1
else
    log "sm_$arch is not served by the triton backend ('auto' takes blocked there): no compile table"
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

# SDPA is every run's floor; --peers with no names: no materialised or Hugging Face peer (they need (N, N, D)).
COMMON=(--dtype bfloat16 --backends triton --max-relative-position 64 --heads 8 --batch 1
        --lengths 1024 2048 4096 8192 16384 32768 --repeats 10 --warmup 2 --time-limit 15 --peers)
bench bench-d64 45 --head-dim 64 "${COMMON[@]}"
bench bench-d64-causal 40 --head-dim 64 --causal "${COMMON[@]}"
bench bench-d128 45 --head-dim 128 "${COMMON[@]}"
bench bench-d128-causal 40 --head-dim 128 --causal "${COMMON[@]}"

secs=$(left)
if ((secs < 85)); then
    log "skipping peers: out of time"
    status=1
else
    log "peers: triton, SDPA-flash, FlexAttention with the key term; TFLOP/s (at most 75 s)"
    timeout 75 "$PY" - "$OUT" <<'EOF'
import json, os, sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from relattn import relative_attention

out_dir, dev = sys.argv[1], torch.device("cuda")
K, B, H, reps = 64, 2, 16, 10
try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
except Exception as exc:  # an old torch
    flex = None
    print(f"no FlexAttention ({type(exc).__name__}: {exc})")


def median_ms(fn):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def timed(fn, leaves, go, backward):
    """Median ms of fn() (forward, no grad) or of fn().backward(go) (forward + backward)."""
    if not backward:
        with torch.no_grad():
            return median_ms(fn)

    def step():
        fn().backward(go)
        for t in leaves:
            t.grad = None

    return median_ms(step)


rows = []
g = torch.Generator(device=dev).manual_seed(0)
for d in (64, 128):
    for causal in (False, True):
        for n in (4096, 8192):
            q, k, v = (torch.randn(B, H, n, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
                       for _ in range(3))
            rk, rv = (0.3 * torch.randn(2 * K + 1, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
            rk, rv = rk.requires_grad_(), rv.requires_grad_()
            go = torch.randn(B, H, n, d, device=dev, dtype=torch.bfloat16, generator=g)
            scale = d ** -0.5

            def ours():
                return relative_attention(q, k, v, rk, rv, max_relative_position=K, is_causal=causal,
                                          backend="triton")

            def sdpa():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            fns = {"triton": ours, "sdpa_flash": sdpa}
            leaves = (q, k, v, rk, rv)
            if d == 64 and not causal:  # DeBERTa's shape: the key term and the position-to-content term, no a^V
                rq = (0.3 * torch.randn(2 * K + 1, d, device=dev, dtype=torch.bfloat16, generator=g)).requires_grad_()

                def ours_rel_q():
                    return relative_attention(q, k, v, rk, None, rel_q=rq, max_relative_position=K, backend="triton")

                fns["triton_rel_q"] = ours_rel_q
                leaves = (*leaves, rq)
            if flex is not None:
                block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n) if causal else None

                def flex_key_term():
                    qa = q @ rk.transpose(0, 1)  # (B, H, N, 2K+1): the key term's scores, one GEMM

                    def score_mod(score, b, h, i, j):
                        return score + qa[b, h, i, torch.clamp(j - i, -K, K) + K] * scale

                    return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)

                fns["flex_key_term"] = flex_key_term
            flops = 4 * B * H * n * n * d * (0.5 if causal else 1.0)  # FlashAttention's count, forward
            for pass_, backward, mult in (("fwd", False, 1.0), ("fwd+bwd", True, 3.5)):
                times = {}
                for name, fn in fns.items():
                    try:
                        times[name] = timed(fn, leaves, go, backward)
                    except Exception as exc:
                        print(f"  {name} {pass_} failed: {type(exc).__name__}: {str(exc)[:200]}")
                base = times.get("sdpa_flash")
                for name, ms in times.items():
                    tflops = mult * flops / (ms * 1e-3) / 1e12
                    ratio = ms / base if base else float("nan")
                    rows.append({"impl": name, "pass": pass_, "n": n, "head_dim": d, "causal": causal, "ms": ms,
                                 "tflops": tflops, "ratio_to_sdpa_flash": ratio})
                    print(f"N={n} D={d} {'causal' if causal else 'full'} {pass_:8s} {name:14s} {ms:8.3f} ms "
                          f"{tflops:6.1f} TFLOP/s  x{ratio:.2f} SDPA-flash", flush=True)
result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bfloat16", "batch": B,
          "heads": H, "max_relative_position": K,
          "timing": f"median of {reps} calls after 3 warm-up calls, CUDA events",
          "flops": "4 B H N^2 D forward (halved when causal), 3.5x that forward+backward (FlashAttention's count)",
          "rows": rows}
with open(os.path.join(out_dir, "peers.json"), "w") as f:
    json.dump(result, f, indent=1)
EOF
    rc=$?
    log "peers exit code $rc"
    ((rc == 0)) || status=1
fi

secs=$(left)
if ((secs < 20)); then
    log "skipping decode: out of time"
    status=1
else
    log "decode: one query against 32768 cached keys (at most $((secs > 45 ? 45 : secs)) s)"
    timeout $((secs > 45 ? 45 : secs)) "$PY" - "$OUT" <<'EOF'
import json, os, sys

import torch
import torch.nn.functional as F

from relattn import relative_attention

out_dir, dev = sys.argv[1], torch.device("cuda")
M, K, reps = 32768, 64, 50


def median_ms(fn):
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


rows = []
g = torch.Generator(device=dev).manual_seed(0)
for b, h, d in ((1, 16, 64), (1, 16, 128), (8, 16, 64), (8, 16, 128)):
    q = torch.randn(b, h, 1, d, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, h, M, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    rk, rv = (0.3 * torch.randn(2 * K + 1, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    with torch.no_grad():
        ours = median_ms(lambda: relative_attention(q, k, v, rk, rv, max_relative_position=K, is_causal=True,
                                                    query_offset=M - 1, backend="triton"))
        sdpa = median_ms(lambda: F.scaled_dot_product_attention(q, k, v))
    flops = 4 * b * h * M * d
    rows.append({"batch": b, "heads": h, "head_dim": d, "cached_keys": M, "max_relative_position": K,
                 "triton_ms": ours, "sdpa_ms": sdpa, "ratio": ours / sdpa,
                 "triton_tflops": flops / (ours * 1e-3) / 1e12, "sdpa_tflops": flops / (sdpa * 1e-3) / 1e12})
    print(f"decode B={b} H={h} D={d} M={M}: triton {ours:.3f} ms ({rows[-1]['triton_tflops']:.2f} TFLOP/s), "
          f"SDPA {sdpa:.3f} ms ({rows[-1]['sdpa_tflops']:.2f} TFLOP/s), x{ours / sdpa:.2f}")
result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bfloat16",
          "timing": f"median of {reps} calls after 10 warm-up calls, CUDA events, torch.no_grad()", "rows": rows}
tmp = os.path.join(out_dir, "decode.json.tmp")
with open(tmp, "w") as f:
    json.dump(result, f, indent=1)
os.replace(tmp, os.path.join(out_dir, "decode.json"))
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"B={r['batch']} D={r['head_dim']}" for r in rows]
    ax.bar(labels, [r["ratio"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("triton time / SDPA time")
    ax.set_title(f"decoding: 1 query vs {M} keys, bf16, K={K} ({result['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "decode.png"), dpi=120)
except ImportError:
    print("no matplotlib: decode.png not written")
EOF
    rc=$?
    log "decode exit code $rc"
    ((rc == 0)) || status=1
fi

log "done, exit code $status; results in $OUT"
exit $status
