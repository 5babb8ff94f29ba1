#!/usr/bin/env bash
# The GPU tier on a lent GPU, after ../shared/gpu/README.md's install:
#   bash tests/gpu/run.sh [OUT_DIR]
# Writes OUT_DIR/gpu-tier.log and OUT_DIR/gpu-tier.json (device, versions, each case).
set -u
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-docs/bench/gpu}}
mkdir -p "$out"
[ -f .gpu/tools/env.sh ] && . .gpu/tools/env.sh
python3 -c "import pytest" 2>/dev/null || { echo "pytest is missing on this machine: add pytest, pluggy and iniconfig wheels to the install"; exit 2; }
HS_GPU_REPORT="$out/gpu-tier.json" python3 -m pytest -q -p no:cacheprovider tests/gpu "${@:2}" 2>&1 | tee "$out/gpu-tier.log"
exit "${PIPESTATUS[0]}"
