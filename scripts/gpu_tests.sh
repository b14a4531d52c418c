#!/usr/bin/env bash
# Run the GPU suite (tests marked gpu / multigpu) on a CUDA machine, compiled for
# the device (no interpreter), in named parts that each fit one device session
# (8 minutes on one H200):
#
#   scripts/gpu_tests.sh PART [pytest args]    e.g. scripts/gpu_tests.sh gemm -x
#   scripts/gpu_tests.sh all [pytest args]     every part in turn, one pytest each
#   scripts/gpu_tests.sh --list                the parts, one line each
#
# Every gpu / multigpu test belongs to exactly one part (tests/test_gpu_parts.py
# checks it on CPU): a new GPU test file goes into one of the PARTS below.
# PYTHON names the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

# part | test files | -k expression (empty: all of the files' GPU tests) | what it covers
PARTS=(
  "gemm|tests/gemm/test_gemm_gpu.py tests/gemm/test_split_k_streams_gpu.py tests/gemm/test_quantize_kernel.py|not every_pickable|the MXFP8 GEMM, its split-K streams and the quantizer"
  "exhaustive|tests/gemm/test_gemm_gpu.py|every_pickable|every tactic the GEMM can pick, against its bar"
  "boundary|tests/boundary/test_boundary_multigpu.py tests/boundary/test_boundary_dead_peer_multigpu.py tests/boundary/test_consumer_numerics.py||the all-reduce and its consumer (multi-GPU parts skip on one GPU)"
  "mixes|tests/mixes/test_boundary_mixes.py tests/mixes/test_consumer_mixes.py||the next sublayer's mixes in the consumer and the next GEMM"
  "chain|tests/model/test_chain.py tests/model/test_chain_multigpu.py tests/cli/test_cli.py tests/bench/test_bench_user_mixes.py||the model chain, the CLI end to end and the bench's user mixes kernel"
  "compile|tests/model/test_compile_gpu.py||torch.compile and CUDA graphs of the step"
  "tune|tests/bench/test_tune.py||the tune command inside the chain"
)

usage() {
  echo "usage: scripts/gpu_tests.sh PART|all|--list [pytest args]; parts:" >&2
  list >&2
}

list() {
  local entry
  for entry in "${PARTS[@]}"; do
    IFS='|' read -r name files expr what <<<"$entry"
    echo "$name|$files|$expr|$what"
  done
}

run_part() {  # run_part NAME [pytest args]
  local want=$1 entry
  shift
  for entry in "${PARTS[@]}"; do
    IFS='|' read -r name files expr _ <<<"$entry"
    if [[ $name == "$want" ]]; then
      # The log of the part's last run: benchmarks/results/gpu-tests-NAME.log
      # (GPU_TESTS_LOG_DIR elsewhere, e.g. the device's $OUT).
      local log="${GPU_TESTS_LOG_DIR:-benchmarks/results}/gpu-tests-$name.log"
      mkdir -p "$(dirname "$log")"
      # shellcheck disable=SC2086  # files: a space-separated list
      "${PYTHON:-python3}" -m pytest -m "gpu or multigpu" ${expr:+-k "$expr"} -q $files "$@" \
        2>&1 | tee "$log"
      return
    fi
  done
  echo "scripts/gpu_tests.sh: unknown part '$want'" >&2
  usage
  return 2
}

if [[ $# -lt 1 ]]; then
  usage
  exit 2
fi
part=$1
shift
if [[ $part == --list ]]; then
  list
  exit 0
fi

export DECODE_BOUNDARY_GPU_TESTS=1 TRITON_INTERPRET=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ $part != all ]]; then
  run_part "$part" "$@"
  exit
fi
failed=()
for entry in "${PARTS[@]}"; do
  name=${entry%%|*}
  echo "== gpu_tests part: $name" >&2
  run_part "$name" "$@" || failed+=("$name")
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "scripts/gpu_tests.sh: failed parts: ${failed[*]}" >&2
  exit 1
fi
