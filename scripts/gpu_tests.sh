#!/usr/bin/env bash
# Run the GPU suites (tests marked gpu / multigpu) on a CUDA machine, compiled for
# the device (no interpreter). Extra arguments go to pytest, e.g. -k consumer.
set -euo pipefail
cd "$(dirname "$0")/.."
export DECODE_BOUNDARY_GPU_TESTS=1 TRITON_INTERPRET=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m pytest -m "gpu or multigpu" -q "$@"
