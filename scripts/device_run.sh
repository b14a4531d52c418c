#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks, each bounded, logs under $OUT.
# Usage (on the device machine): scripts/device_run.sh "<pytest args>" "<command>" ...
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 DECODE_BOUNDARY_COMMIT="${DECODE_BOUNDARY_COMMIT:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
i=0
for step in "$@"; do
  i=$((i + 1))
  echo "=== [$i] $step"
  start=$(date +%s)
  bash -c "$step" > "$OUT/step$i.log" 2>&1
  echo "rc=$? in $(( $(date +%s) - start )) s"
  tail -n 25 "$OUT/step$i.log"
done
