#!/usr/bin/env bash
# The GPU tier and the paired CUDA benchmark in one budgeted command, in priority order:
#   bash tests/gpu/run.sh [--budget SECONDS] [--plan] [--steps a,b] [OUT]   (default 540 s, OUT=$OUT or docs/bench/gpu)
# Each step runs under `timeout -k` in its own process group (SIGINT, then SIGKILL: vLLM engine processes may
# ignore SIGINT); whatever it started that outlives it (a server in its own session) is reaped by its
# HS_GPU_STEP tag. Each step writes OUT/STEP.log as it goes and its entry of OUT/gpu-run.json (planned ->
# running -> passed / failed / timed_out / skipped), so a step killed, or a call cut off, keeps its record.
# A step is given at most its share (the plan), never more than what is left of the budget; the benchmark,
# last, gets the rest. Without a GPU (or with --plan) it prints the plan; GPU-only steps are then skipped.
set -u

KILL_AFTER=${HS_GPU_KILL_AFTER:-10}  # seconds between SIGINT and SIGKILL
MIN_GIVEN=${HS_GPU_MIN_GIVEN:-30}    # a step given less than this is skipped ("budget spent")

# name : share of the default budget in s (0: the rest) : GPU-only : what it shows
STEPS=(
  "kernel:40:1:capture kernel vs the aten gather, bit for bit, CUDA graph replay"
  "engine:130:1:one engine, vLLM's CUDA defaults (compiled, CUDA graphs, its runner and scheduling): last/all/prompt, capture points, attention patterns, steering, chunked prefill, prefix cache, n=2, stop strings"
  "serve:70:1:vllm serve through the openai client, streamed and not"
  "engines:80:1:the same checks on V1 + sync scheduling and on an eager engine"
  "special:70:1:preemption and n-gram speculative decoding"
  "bench:0:1:paired engine benchmark against plain vLLM (benchmarks/gpu/engine.py)"
)

_now() { printf '%s' "${EPOCHREALTIME:-$(date +%s)}"; }
_secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
_summary() { "$SUMMARY_PY" tests/gpu/summary.py "$@"; }

# SIGKILL every process carrying HS_GPU_STEP=TAG in its environment: what a step started and left behind,
# even in a session of its own (timeout's group kill does not reach those). Only this run's processes
# carry the tag.
reap() {
  local tag=$1 d pid n=0
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$pid" = "$$" ] && continue
    if grep -qzx "HS_GPU_STEP=$tag" "$d/environ" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null && n=$((n + 1))
    fi
  done
  [ "$n" -gt 0 ] && echo "  reaped $n leftover process(es) of step ${tag##*-}"
  return 0
}

# run_step NAME GIVEN_S CMD...: CMD under `timeout -k KILL_AFTER -s INT (GIVEN_S - KILL_AFTER)`, output to
# OUT/NAME.log, its entry in the summary before and after. Returns CMD's status (124/137: timed out).
run_step() {
  local name=$1 given=$2; shift 2
  local tag="$RUN_ID-$name" start rc status
  _summary set "$out" "$name" status=running given_s="$given" log="$name.log" started="\"$(date +%T)\""
  echo "[$(date +%T)] $name: up to $given s"
  start=$(_now)
  HS_GPU_STEP=$tag timeout -k "$KILL_AFTER" -s INT "$((given - KILL_AFTER))" "$@" \
    > "$out/$name.log" 2>&1 < /dev/null
  rc=$?
  reap "$tag"
  case $rc in
    0) status=passed ;;
    124 | 137) status=timed_out ;;
    *) status=failed ;;
  esac
  _summary set "$out" "$name" status=$status rc=$rc seconds="$(_secs "$start" "$(_now)")"
  echo "[$(date +%T)] $name: $status (rc $rc) after $(_secs "$start" "$(_now)") s"
  if [ "$status" != passed ]; then
    echo "  --- last lines of $name.log ---"
    tail -n 15 "$out/$name.log" | cut -c1-300 | sed 's/^/  /'
  fi
  return "$rc"
}

# The command of each step, given GIVEN_S seconds.
run_named() {
  local name=$1 given=$2
  local pytest=("$PY" -m pytest -v -s -p no:cacheprovider -o console_output_style=classic)
  # Each pytest step's per-case report (folded into the summary), and where its servers log.
  local env=(env HS_GPU_REPORT="$out/$name.cases.json" HS_GPU_OUT="$out")
  case $name in
    kernel) run_step "$name" "$given" "${env[@]}" "${pytest[@]}" tests/gpu/test_capture_kernel_gpu.py ;;
    engine) run_step "$name" "$given" "${env[@]}" HS_GPU_ENGINES=default "${pytest[@]}" \
      tests/gpu/test_engine_gpu.py ;;
    serve) run_step "$name" "$given" "${env[@]}" "${pytest[@]}" tests/gpu/test_serve_gpu.py ;;
    engines) run_step "$name" "$given" "${env[@]}" HS_GPU_ENGINES=v1-sync,eager "${pytest[@]}" \
      tests/gpu/test_engine_gpu.py ;;
    special) run_step "$name" "$given" "${env[@]}" "${pytest[@]}" tests/gpu/test_engine_special_gpu.py ;;
    bench) run_step "$name" "$given" "$PY" -m benchmarks.gpu.engine --out "$out/bench" \
      --deadline-s "$((given - KILL_AFTER - 20))" ;;
    *) echo "unknown step $name" >&2; return 2 ;;
  esac
}

# given NOMINAL LEFT: what a step of share NOMINAL gets with LEFT seconds of the budget left.
given() {
  local nominal=$1 left=$2
  if [ "$nominal" -eq 0 ] || [ "$nominal" -gt "$left" ]; then echo "$left"; else echo "$nominal"; fi
}

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

main() {
  local budget=540 plan=0 only="" arg
  out=""
  while [ $# -gt 0 ]; do
    arg=$1; shift
    case $arg in
      --budget) budget=$1; shift ;;
      --budget=*) budget=${arg#*=} ;;
      --plan | --dry-run) plan=1 ;;
      --steps) only=$1; shift ;;
      --steps=*) only=${arg#*=} ;;
      -h | --help) usage; return 0 ;;
      -*) echo "unknown option $arg" >&2; usage >&2; return 2 ;;
      *) out=$arg ;;
    esac
  done
  case $budget in '' | *[!0-9]*) echo "--budget takes whole seconds, not '$budget'" >&2; return 2 ;; esac
  out=${out:-${OUT:-docs/bench/gpu}}
  mkdir -p "$out" && out=$(cd "$out" && pwd)
  RUN_ID="$$-$(date +%s)"

  # The device's environment (../shared/gpu: /tmp/site on PYTHONPATH, the carried NCCL), then ours.
  [ -f .gpu/tools/env.sh ] && . .gpu/tools/env.sh
  # FlashInfer 0.7.0.post1 has no matching flashinfer-cubin: its top-k/top-p sampler JIT-builds with ninja
  # for minutes at Model Runner V2's warm-up. PyTorch's sampler instead (V1 and V2 both honour this).
  export VLLM_USE_FLASHINFER_SAMPLER=0
  export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO} PYTHONUNBUFFERED=1
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  PY=${HS_GPU_PYTHON:-python3}
  [ -z "${HS_GPU_PYTHON:-}" ] && [ ! -f .gpu/tools/env.sh ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
  SUMMARY_PY=python3

  local gpu=""
  if [ -z "${HS_GPU_ASSUME_NONE:-}" ] && command -v nvidia-smi > /dev/null 2>&1; then
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)
  fi

  # The plan: each step's time if every step before it takes all of its own.
  local spec name nominal gpu_only what left=$budget g specs=() first3=0 i=0
  echo "GPU tier plan: budget $budget s, kill-after $KILL_AFTER s, GPU: ${gpu:-none}, OUT $out"
  for spec in "${STEPS[@]}"; do
    IFS=: read -r name nominal gpu_only what <<< "$spec"
    i=$((i + 1))
    g=$(given "$nominal" "$left")
    [ "$g" -lt "$MIN_GIVEN" ] && g=0
    [ -n "$only" ] && [[ ",$only," != *",$name,"* ]] && g=0 what="(not in --steps) $what"
    left=$((left - g))
    [ "$i" -le 3 ] && first3=$((first3 + g))
    specs+=("$name:$g:$gpu_only")
    printf '  %d. %-8s %4d s%s  %s\n' "$i" "$name" "$g" \
      "$([ "$nominal" -eq 0 ] && echo ' (the rest)' || echo '')" "$what"
  done
  echo "  steps 1-3: $first3 s; time a step does not use goes to the benchmark"
  _summary init "$out" "$budget" "$gpu" "${specs[@]}" || return 2
  if [ "$plan" = 1 ]; then
    echo "plan only (--plan): nothing run; $out/gpu-run.json lists the steps as planned"
    return 0
  fi
  [ -z "$gpu" ] && echo "no GPU (nvidia-smi lists none): every step here is GPU-only and is skipped"
  if [ -n "$gpu" ] && ! "$PY" -c "import pytest" 2> /dev/null; then
    echo "pytest is missing on this machine: add pytest, pluggy and iniconfig wheels to the install" >&2
    return 2
  fi

  local started=$SECONDS status=0
  for spec in "${STEPS[@]}"; do
    IFS=: read -r name nominal gpu_only what <<< "$spec"
    if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then
      _summary set "$out" "$name" status=skipped reason='"not in --steps"'
      continue
    fi
    if [ "$gpu_only" = 1 ] && [ -z "$gpu" ]; then
      _summary set "$out" "$name" status=skipped reason='"no GPU"'
      continue
    fi
    left=$((budget - (SECONDS - started)))
    g=$(given "$nominal" "$left")
    if [ "$g" -lt "$MIN_GIVEN" ]; then
      _summary set "$out" "$name" status=skipped given_s="$g" reason='"budget spent"'
      echo "[$(date +%T)] $name: skipped, $left s of the budget left"
      continue
    fi
    run_named "$name" "$g" || status=1
  done
  _summary finish "$out" || status=1
  return $status
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  cd "$(dirname "$0")/../.." || exit 2
  main "$@"
  exit $?
fi
