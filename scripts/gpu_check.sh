#!/usr/bin/env bash
# Kernel check for a machine with an NVIDIA GPU (H100/H200; an A100 runs the Triton half):
#   1. scripts/gpu_kernel_check.py: every kernel compiled for the GPU against the reference
#      (the CI cases plus larger Llama-3-8B-shaped ones), one line per case;
#   2. scripts/gpu_kernel_bench.py: decode attention at batch 1/8/64/256 x context 1k/4k/16k,
#      achieved KV bytes/s against measured copy bandwidth, for our kernels, the XLA path and
#      jax's deprecated Triton paged_attention, one line per measurement;
#   3. scripts/gpu_parity_check.py: greedy parity through the engine (float32, a random-weight
#      model of the embedded SmolLM2-135M's shape built from a seed): attention_impl=gpu against
#      the reference path and both against HF transformers, one `parity ...` line per comparison.
#      Extra flags in GPU_PARITY_ARGS (e.g. "--matmul-precision highest").
# GPU_CHECK_BENCH_BUDGET_S (default 130) trims step 2 when device time is short.
# Finishes in under 8 minutes (each step has a hard timeout: 100 + 165 + 190 s); paste its output
# into docs/kernels.md ("Numbers on a GPU"). Usage: scripts/gpu_check.sh [python]
# The python needs jax, torch and transformers, not our install (PYTHONPATH is set to the checkout;
# the parity step maps jaxserve.sched/checkpoints itself, as jaxserve.bench.run_from_checkout does).
set -u
cd "$(dirname "$0")/.."
PY="${1:-${PYTHON:-}}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS="ignore::DeprecationWarning"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"

echo "gpu_check: $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
"$PY" -c "import jax; print('gpu_check: jax', jax.__version__, jax.devices())" || exit 1

timeout 100 "$PY" scripts/gpu_kernel_check.py 2> /tmp/gpu_kernel_check.err
check_rc=$?
[ $check_rc -ne 0 ] && tail -n 30 /tmp/gpu_kernel_check.err

BENCH_BUDGET="${GPU_CHECK_BENCH_BUDGET_S:-130}"   # the kernel bench's own budget; its timeout is 35 s more
timeout $(( BENCH_BUDGET + 35 )) "$PY" scripts/gpu_kernel_bench.py --time-budget "$BENCH_BUDGET" 2> /tmp/gpu_kernel_bench.err
bench_rc=$?
[ $bench_rc -ne 0 ] && tail -n 30 /tmp/gpu_kernel_bench.err

# shellcheck disable=SC2086  # GPU_PARITY_ARGS is a list of flags
timeout -k 5 190 "$PY" scripts/gpu_parity_check.py ${GPU_PARITY_ARGS:-} 2> /tmp/gpu_parity_check.err
parity_rc=$?
[ $parity_rc -ne 0 ] && tail -n 30 /tmp/gpu_parity_check.err

echo "gpu_check: kernel-check rc=$check_rc, bench rc=$bench_rc, parity rc=$parity_rc (124/137 = timed out)"
[ $check_rc -eq 0 ] && [ $bench_rc -eq 0 ] && [ $parity_rc -eq 0 ]
