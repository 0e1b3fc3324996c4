#!/usr/bin/env bash
# Benchmarks for a machine with an NVIDIA GPU (H100/H200), filling docs/benchmarks.md's
# "GPU (NVIDIA H100/H200)" section:
#   a. the GPU (nvidia-smi: name, driver, memory) and the devices jax and torch see;
#   b. a random-weight Llama-3-8B-shaped model in bfloat16, built on the GPU and saved as an HF
#      directory (python -m jaxserve.bench.random_model; cached in $GPU_BENCH_CACHE, reused);
#   c. batch-1 decode: `bench latency`, 128-token prompts, exactly 128 output tokens (EOS
#      ignored), per backend: jaxserve, hf, and vllm when it is importable;
#   d. saturation: `bench throughput`, 256 random-text prompts of 512 tokens, 256 output tokens
#      each, all sent at once, per backend;
#   e. results: JSON per run in docs/results/gpu-*.json, `bench report` (markdown table, also
#      docs/results/gpu-report.md), combined PNG plots;
#   f. one line per backend: batch-1 TPOT, the weight-read bandwidth it implies (weight bytes
#      read per decode step / TPOT) against the GPU's peak HBM bandwidth, saturation tokens/s.
# Each backend runs in its own process (jax preallocates most of the GPU; torch and vLLM need it
# too). Every step has a hard timeout inside a total budget (GPU_BENCH_BUDGET_S, default 540 s):
# a step that fails or times out prints the tail of its stderr and the script goes on; a step
# that no longer fits the budget is skipped. Exit status: 0 only if every step succeeded.
# Usage: scripts/gpu_bench.sh [--host | --moe] [--tensor-parallel-size 1,2,4] [python]
#   --tensor-parallel-size LIST: instead of c/d per backend, jaxserve alone at each tensor-parallel
#   size of LIST (batch-1 decode and saturation per size, results gpu-{latency,throughput}-jaxserve-tpN);
#   --host: instead of b-f, the host path against the device (`bench host`, issue 32): host ms per
#   decode step and its parts against the device's wait, at 1/16/64/256 running requests, for a
#   random model of the embedded model's shape in bfloat16 (GPU_BENCH_HOST_SHAPES, default
#   smollm2-135m,tiny: the tiny one's device step is ~0, so its host figure is the host alone);
#   each shape as one launch per step, as the two-launch step and with XLA's command buffers off
#   (GPU_BENCH_HOST_VARIANTS, default fused,two-launch,no-command-buffers); results
#   gpu-host-SHAPE-VARIANT.json in $RESULTS. About 5 minutes on a GPU.
#   --moe: instead of b-f, the mixture-of-experts benchmark (scripts/bench_moe.py): a random
#   Qwen3-30B-A3B-shaped MoE (30.5 B parameters, 3.3 B active; 61 GB in bfloat16, drawn on the GPU,
#   no checkpoint written) against a dense model of its active parameters and against itself
#   computed densely (every expert for every token), decode and prefill row counts, tokens/s and
#   ratios; its output is stdout and $LOGS/moe-bench.out. Give it GPU_BENCH_BUDGET_S=1500 (drawing
#   61 GB and compiling three 48-layer forwards per row count; GPU_BENCH_MOE_SIZES, default
#   1,8,64,512,2048, and GPU_BENCH_MOE_REPEATS, default 10, trim it). GPU_BENCH_MOE_SHAPE=small runs the CPU
#   shape (a dry run: GPU_BENCH_MOE_SHAPE=small GPU_BENCH_DTYPE=float32 scripts/gpu_bench.sh --moe).
#   needs that many GPUs (the mesh takes the first N devices); results and plots in $RESULTS/tp. Give it a budget that fits
#   (GPU_BENCH_BUDGET_S, e.g. 1500 for 1,2,4). On a CPU, GPU_BENCH_DEVICE=cpu fakes as many CPU
#   devices as the largest size.
#
# Environment (defaults for the GPU run):
#   GPU_BENCH_SHAPE=llama3-8b   GPU_BENCH_DTYPE=bfloat16   GPU_BENCH_DEVICE=cuda (where weights are made)
#   GPU_BENCH_CACHE=/tmp/jaxserve-gpu-bench (model cache and logs)
#   GPU_BENCH_RESULTS=docs/results (llama3-8b) or $GPU_BENCH_CACHE/results-SHAPE (other shapes)
#   GPU_BENCH_BACKENDS=jaxserve,hf,vllm   GPU_BENCH_BUDGET_S=540
#   GPU_BENCH_LATENCY_INPUT_LEN=128 GPU_BENCH_LATENCY_OUTPUT_LEN=128 GPU_BENCH_LATENCY_ITERS=3
#   GPU_BENCH_NUM_PROMPTS=256 GPU_BENCH_INPUT_LEN=512 GPU_BENCH_OUTPUT_LEN=256 GPU_BENCH_HF_BATCH=64
#   GPU_BENCH_JAXSERVE_ARGS="..." replaces the jaxserve engine flags below (e.g. add
#     "--engine-arg attention_impl=xla" if the Pallas kernel fails to compile)
# Dry run on a CPU (tiny model, small workloads, about 2-3 minutes):
#   GPU_BENCH_SHAPE=tiny GPU_BENCH_DEVICE=cpu scripts/gpu_bench.sh
set -u
cd "$(dirname "$0")/.."
REPO="$PWD"
TP_SIZES=""
MOE=0
HOST=0
if [ "${1:-}" = "--host" ]; then
  HOST=1
  shift
fi
if [ "${1:-}" = "--moe" ]; then
  MOE=1
  shift
fi
if [ "${1:-}" = "--tensor-parallel-size" ]; then
  TP_SIZES="${2:?--tensor-parallel-size needs a comma-separated list, e.g. 1,2,4}"
  shift 2
fi
PY="${1:-${PYTHON:-}}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS="ignore::DeprecationWarning"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"

SHAPE="${GPU_BENCH_SHAPE:-llama3-8b}"
DTYPE="${GPU_BENCH_DTYPE:-bfloat16}"
DEVICE="${GPU_BENCH_DEVICE:-cuda}"
CACHE="${GPU_BENCH_CACHE:-/tmp/jaxserve-gpu-bench}"
BACKENDS="${GPU_BENCH_BACKENDS:-jaxserve,hf,vllm}"
BUDGET="${GPU_BENCH_BUDGET_S:-540}"
RESERVE=40       # seconds kept for the report and summary at the end (20 s each at most)
MIN_STEP=30      # a step is not started with less time than this
KILL_GRACE=10    # timeout -k: SIGKILL this long after SIGTERM

if [ "$SHAPE" = llama3-8b ]; then
  RESULTS="${GPU_BENCH_RESULTS:-$REPO/docs/results}"
  LAT_IN=128 LAT_OUT=128 LAT_ITERS=3
  NUM_PROMPTS=256 IN_LEN=512 OUT_LEN=256 HF_BATCH=64
  # 8,192 KV blocks of 16 tokens = 131,072 tokens = 16 GiB of bf16 KV (128 KiB per token): 128
  # sequences of 768 tokens need 98,304. Two decode and two prefill buckets keep the start-up
  # compile to 4 step shapes, compiled once in the latency run and read back from the persistent
  # XLA cache by the throughput run (same flags = same executables).
  JAX_DEFAULT="--max-model-len 1024 --max-num-seqs 128 --max-num-batched-tokens 1024 --num-kv-blocks 8192
    --engine-arg decode_buckets=(1,128) --engine-arg prefill_buckets=(0,64)"
  CAP_BUILD=300 CAP_LAT=240 CAP_THR=300 CAP_VLLM=240
else
  RESULTS="${GPU_BENCH_RESULTS:-$CACHE/results-$SHAPE}"
  LAT_IN=32 LAT_OUT=16 LAT_ITERS=2
  NUM_PROMPTS=8 IN_LEN=32 OUT_LEN=16 HF_BATCH=4
  JAX_DEFAULT="--max-model-len 64 --max-num-seqs 8 --max-num-batched-tokens 64 --num-kv-blocks 64
    --engine-arg decode_buckets=(1,8) --engine-arg prefill_buckets=(0,4)"
  CAP_BUILD=120 CAP_LAT=150 CAP_THR=150 CAP_VLLM=150
fi
LAT_IN="${GPU_BENCH_LATENCY_INPUT_LEN:-$LAT_IN}"
LAT_OUT="${GPU_BENCH_LATENCY_OUTPUT_LEN:-$LAT_OUT}"
LAT_ITERS="${GPU_BENCH_LATENCY_ITERS:-$LAT_ITERS}"
NUM_PROMPTS="${GPU_BENCH_NUM_PROMPTS:-$NUM_PROMPTS}"
IN_LEN="${GPU_BENCH_INPUT_LEN:-$IN_LEN}"
OUT_LEN="${GPU_BENCH_OUTPUT_LEN:-$OUT_LEN}"
HF_BATCH="${GPU_BENCH_HF_BATCH:-$HF_BATCH}"
read -r -d '' -a JAX_ARGS <<< "${GPU_BENCH_JAXSERVE_ARGS:-$JAX_DEFAULT}"

MODEL="$CACHE/$SHAPE-$DTYPE"
LOGS="$CACHE/logs"
PREFIX=gpu
if [ -n "$TP_SIZES" ]; then
  # its own files and folder: a TP run never deletes or overwrites the per-backend results and plots
  PREFIX=gpu-tp
  [ -z "${GPU_BENCH_RESULTS:-}" ] && RESULTS="$RESULTS/tp"
fi
mkdir -p "$CACHE" "$LOGS" "$RESULTS" || exit 1

START=$SECONDS
FAILED=()
WRITTEN=()
FINAL=0          # 1: the closing steps, which run whatever the budget says (they take seconds)
JX=("$PY" -m jaxserve.bench.run_from_checkout jaxserve.cli)   # `jaxserve` without installing it
NO_PREALLOC=(env XLA_PYTHON_CLIENT_PREALLOCATE=false)        # processes where jax must not grab the GPU

# step NAME CAP COMMAND...: runs COMMAND under a timeout of min(CAP, what the budget leaves),
# stdout and stderr to $LOGS/NAME.{out,err}; prints stdout on success, the stderr tail on failure.
step() {
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - (SECONDS - START) - RESERVE - KILL_GRACE ))
  [ "$FINAL" = 1 ] && left=$cap
  local limit=$(( cap < left ? cap : left ))
  if [ "$FINAL" != 1 ] && [ "$limit" -lt "$MIN_STEP" ]; then
    echo "gpu_bench: $name: SKIPPED, $(( left > 0 ? left : 0 )) s of the ${BUDGET} s budget left"
    FAILED+=("$name(skipped)")
    return 1
  fi
  echo "gpu_bench: $name: started $(date -u +%T), timeout ${limit} s"
  local t0=$SECONDS rc
  timeout -k "$KILL_GRACE" "$limit" "$@" > "$LOGS/$name.out" 2> "$LOGS/$name.err"
  rc=$?
  if [ $rc -eq 0 ]; then
    grep -v '^[[:space:]]*$' "$LOGS/$name.out" | sed 's/^/    /'
    echo "gpu_bench: $name: ok in $(( SECONDS - t0 )) s"
  else
    echo "gpu_bench: $name: FAILED rc=$rc (124/137 = timed out) after $(( SECONDS - t0 )) s; end of its stderr:"
    tail -n 30 "$LOGS/$name.err" | sed 's/^/    /'
    FAILED+=("$name")
  fi
  return $rc
}

# bench SUBCOMMAND BACKEND [flags...]: one backend, one process, one JSON named gpu-SUB-BACKEND
bench() {
  local sub=$1 backend=$2; shift 2
  local name="$PREFIX-$sub-$backend" cap=$CAP_LAT
  [ "$sub" = throughput ] && cap=$CAP_THR
  [ "$backend" = vllm ] && cap=$CAP_VLLM
  local extra=()
  [ "$backend" = jaxserve ] && extra=("${JAX_ARGS[@]}")
  local runner=()
  [ "$backend" != jaxserve ] && runner=("${NO_PREALLOC[@]}")
  if step "$name" "$cap" "${runner[@]}" "${JX[@]}" bench "$sub" --model "$MODEL" --backend "$backend" --dtype "$DTYPE" \
      --output-dir "$RESULTS" --name "$name" --no-progress --no-plots "$@" "${extra[@]}"; then
    WRITTEN+=("$RESULTS/$name.json")
  fi
}

# bench_tp SUBCOMMAND SIZE [flags...]: jaxserve at one tensor-parallel size, JSON gpu-SUB-jaxserve-tpSIZE
bench_tp() {
  local sub=$1 tp=$2; shift 2
  local name="$PREFIX-$sub-jaxserve-tp$tp" cap=$CAP_LAT
  [ "$sub" = throughput ] && cap=$CAP_THR
  if step "$name" "$cap" "${JX[@]}" bench "$sub" --model "$MODEL" --backend jaxserve --dtype "$DTYPE" \
      --output-dir "$RESULTS" --name "$name" --no-progress --no-plots "$@" "${JAX_ARGS[@]}" \
      --engine-arg "tensor_parallel_size=$tp"; then
    WRITTEN+=("$RESULTS/$name.json")
  fi
}
if [ -n "$TP_SIZES" ] && [ "$DEVICE" = cpu ]; then
  MOST_TP=$(tr , '\n' <<< "$TP_SIZES" | sort -n | tail -1)
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$MOST_TP"
fi

# -- a. the machine ---------------------------------------------------------------------------
GPU_LINE="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
GPU_NAME="${GPU_LINE%%,*}"
echo "gpu_bench: $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo '+changes')"
echo "gpu_bench: GPU ${GPU_LINE:-none (no nvidia-smi)}; $(nproc) CPUs; python $PY"
echo "gpu_bench: shape $SHAPE $DTYPE (weights made on $DEVICE), backends $BACKENDS, budget ${BUDGET} s, results in $RESULTS"
echo "gpu_bench: jaxserve engine flags: ${JAX_ARGS[*]}"
step devices 90 "${NO_PREALLOC[@]}" "$PY" -c "
import importlib.metadata as md, jax
print('jax', jax.__version__, jax.devices())
try:
    import torch
    print('torch', torch.__version__, 'cuda:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')
except ImportError:
    print('torch: not installed')
for p in ('transformers', 'tokenizers', 'flax', 'vllm', 'matplotlib'):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, 'not installed')
"

if [ "$MOE" = 1 ]; then
  # the MoE benchmark draws its weights on the device: no model directory, no backends
  step moe-bench "$(( BUDGET - RESERVE ))" "$PY" scripts/bench_moe.py --shape "${GPU_BENCH_MOE_SHAPE:-qwen3-30b-a3b}" \
    --dtype "$DTYPE" --sizes "${GPU_BENCH_MOE_SIZES:-1,8,64,512,2048}" --repeats "${GPU_BENCH_MOE_REPEATS:-10}"
  echo "gpu_bench: finished in $(( SECONDS - START )) s"
  [ ${#FAILED[@]} -gt 0 ] && { echo "gpu_bench: FAILED steps: ${FAILED[*]} (logs in $LOGS)"; exit 1; }
  echo "gpu_bench: all steps ok"
  exit 0
fi

if [ "$HOST" = 1 ]; then
  # random models of small shapes, made by `bench host` itself; one process per shape
  IFS=, read -r -a HOST_SHAPES <<< "${GPU_BENCH_HOST_SHAPES:-smollm2-135m,tiny}"
  # each shape three ways (issue 54): one launch per step (the default: the sampler fused into the
  # step, XLA's command buffers as XLA enables them), the two-launch step (fuse_sampler=False),
  # and one launch with command buffers off (--xla_gpu_enable_command_buffer= empty)
  IFS=, read -r -a HOST_VARIANTS <<< "${GPU_BENCH_HOST_VARIANTS:-fused,two-launch,no-command-buffers}"
  for shape in "${HOST_SHAPES[@]}"; do
    for variant in "${HOST_VARIANTS[@]}"; do
      extra=(); flags="${XLA_FLAGS:-}"
      case "$variant" in
        fused) ;;
        two-launch) extra=(--engine-arg fuse_sampler=False) ;;
        no-command-buffers) flags="$flags --xla_gpu_enable_command_buffer=" ;;
        *) echo "gpu_bench: unknown host variant $variant"; FAILED+=("host-$variant"); continue ;;
      esac
      name="gpu-host-$shape-$variant"
      if XLA_FLAGS="$flags" step "$name" 240 "${JX[@]}" bench host --shape "$shape" --dtype "$DTYPE" \
          --batch-sizes "${GPU_BENCH_HOST_BATCHES:-1,16,64,256}" --rounds "${GPU_BENCH_HOST_ROUNDS:-2}" \
          --cache-dir "$CACHE/host" --output-dir "$RESULTS" --name "$name" --no-progress "${extra[@]}"; then
        WRITTEN+=("$RESULTS/$name.json")
      fi
    done
  done
  echo "gpu_bench: finished in $(( SECONDS - START )) s; results: ${WRITTEN[*]:-none}"
  [ ${#FAILED[@]} -gt 0 ] && { echo "gpu_bench: FAILED steps: ${FAILED[*]} (logs in $LOGS)"; exit 1; }
  echo "gpu_bench: all steps ok"
  exit 0
fi

# -- b. the model -----------------------------------------------------------------------------
step build-model "$CAP_BUILD" "$PY" -m jaxserve.bench.random_model --shape "$SHAPE" --dtype "$DTYPE" \
  --device "$DEVICE" "$MODEL" && tail -n 5 "$LOGS/build-model.err" | sed 's/^/    /'

# -- c, d. batch-1 decode, then saturation, one backend per process ----------------------------
IFS=, read -r -a WANTED <<< "$BACKENDS"
RUN=()
for b in "${WANTED[@]}"; do
  case "$b" in
    vllm)
      if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" 2>/dev/null; then
        RUN+=(vllm)
      else
        echo "gpu_bench: vllm is not importable with $PY: not run"
      fi ;;
    jaxserve|hf|hf-cb) RUN+=("$b") ;;
    *) echo "gpu_bench: unknown backend $b"; FAILED+=("backend-$b") ;;
  esac
done
if [ -f "$MODEL/random_model.json" ]; then
  # this run's files replace the last run's: nothing stale is left next to them
  rm -f "$RESULTS/$PREFIX"-latency-*.json "$RESULTS/$PREFIX"-throughput-*.json "$RESULTS/$PREFIX"-*.png \
    "$RESULTS/$PREFIX-report.md"
  LAT=(--batch-size 1 --input-len "$LAT_IN" --output-len "$LAT_OUT" --num-iters "$LAT_ITERS" --num-iters-warmup 1)
  THR=(--dataset random --num-prompts "$NUM_PROMPTS" --input-len "$IN_LEN" --output-len "$OUT_LEN"
       --hf-batch-size "$HF_BATCH")
  # batch 1 for every backend, then saturation (jaxserve's second run finds its step shapes in
  # the persistent XLA cache its first run filled); vLLM last: optional here, and its start-up
  # (graph capture) is the slowest
  if [ -n "$TP_SIZES" ]; then
    # jaxserve alone, at each tensor-parallel size: batch 1 at every size first, then saturation
    IFS=, read -r -a TPS <<< "$TP_SIZES"
    echo "gpu_bench: tensor-parallel sizes ${TPS[*]} (jaxserve only)"
    for tp in "${TPS[@]}"; do bench_tp latency "$tp" "${LAT[@]}"; done
    for tp in "${TPS[@]}"; do bench_tp throughput "$tp" "${THR[@]}"; done
  else
  for b in "${RUN[@]}"; do [ "$b" != vllm ] && bench latency "$b" "${LAT[@]}"; done
  for b in "${RUN[@]}"; do [ "$b" != vllm ] && bench throughput "$b" "${THR[@]}"; done
  for b in "${RUN[@]}"; do
    if [ "$b" = vllm ]; then bench latency vllm "${LAT[@]}"; bench throughput vllm "${THR[@]}"; fi
  done
  fi
else
  echo "gpu_bench: no model in $MODEL: no benchmark ran"
  FAILED+=(benchmarks)
fi

# -- e, f. report and summary -----------------------------------------------------------------
if [ ${#WRITTEN[@]} -gt 0 ]; then
  FINAL=1
  step report 20 "${JX[@]}" bench report "${WRITTEN[@]}" --output "$RESULTS/$PREFIX-report.md"
  PLOTS=(--plots-dir "$RESULTS")
  "$PY" -c "import matplotlib" 2>/dev/null || PLOTS=()
  step summary 20 "$PY" -m jaxserve.bench.gpu_summary --model "$MODEL" --gpu-name "$GPU_NAME" "${PLOTS[@]}" \
    "${WRITTEN[@]}"
fi

echo "gpu_bench: finished in $(( SECONDS - START )) s; results: ${WRITTEN[*]:-none}"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_bench: FAILED steps: ${FAILED[*]} (logs in $LOGS)"
  exit 1
fi
echo "gpu_bench: all steps ok"
