#!/usr/bin/env bash
# The one device call of a lent GPU, after every wheel part but the last has been carried
# (../shared/gpu/README.md; parts from `bash ../shared/gpu/prepare.sh`). Pass in ONE `run` call,
# carrying the last part and .gpu/tools, with timeout_s = CALL_S:
#   mv .gpu/cNN/part-* /tmp/w/parts/ && bash tests/gpu/device_call.sh CALL_S [run.sh options, e.g. --steps bench]
# It installs (device-install.sh: idempotent, ~50 s the first time), then runs tests/gpu/run.sh with
# what is left of CALL_S less a margin (at most BUDGET, default 540), writing under $OUT/gpu (what
# comes back). Copy the returned gpu/ folder to docs/bench/gpu/ and commit it.
set -u
cd "$(dirname "$0")/../.." || exit 2
call_s=${1:-600}
margin=${HS_GPU_CALL_MARGIN:-25}  # for the summary, the copy back, the call's own overhead
out=${OUT:-/tmp/out}/gpu
mkdir -p "$out"
start=$SECONDS
echo "[$(date +%T)] install"
if ! bash .gpu/tools/device-install.sh > "$out/install.log" 2>&1; then
  tail -n 20 "$out/install.log"
  echo "install failed: see $out/install.log"
  exit 2
fi
tail -n 4 "$out/install.log"
. .gpu/tools/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/nvidia-smi.txt" 2>&1
git log -1 --format='%H %s' > "$out/commit.txt" 2> /dev/null || true
budget=$((call_s - (SECONDS - start) - margin))
[ "$budget" -gt "${BUDGET:-540}" ] && budget=${BUDGET:-540}
echo "[$(date +%T)] install took $((SECONDS - start)) s; run budget $budget s"
bash tests/gpu/run.sh --budget "$budget" "${@:2}" "$out"
