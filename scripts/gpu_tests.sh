#!/usr/bin/env bash
# Run the GPU suite (tests marked gpu / multigpu) on a CUDA machine, compiled for
# the device (no interpreter), in named parts that each fit one device session
# (4 minutes on one H100 is the aim):
#
#   scripts/gpu_tests.sh PART [pytest args]    e.g. scripts/gpu_tests.sh gemm -x
#   scripts/gpu_tests.sh all [pytest args]     every part but exhaustive, one pytest each
#   scripts/gpu_tests.sh --list                the parts, one line each
#
# Every gpu / multigpu test belongs to exactly one part (tests/test_gpu_parts.py
# checks it on CPU): a new GPU test file goes into one of the PARTS below.
# PYTHON names the interpreter (default python3). Without a CUDA device visible to
# it the script refuses (exit 2): the suite would skip every test and read as a
# pass. Only a collection (--collect-only / --co) runs without one.
# Each part's log: out/gpu-tests/gpu-tests-PART.log (ignored by git), or under
# GPU_TESTS_LOG_DIR (e.g. the device's $OUT).
set -euo pipefail
cd "$(dirname "$0")/.."

# part | test files | -k expression (empty: all of the files' GPU tests) | what it covers
PARTS=(
  "gemm|tests/gemm/test_gemm_gpu.py tests/gemm/test_split_k_streams_gpu.py tests/gemm/test_quantize_kernel.py|not every_pickable and not publish and not mxfp8_out and not prologue|the MXFP8 GEMM's numerics, shapes, PDL and capture, its split-K streams and the quantizer"
  "gemm-epilogues|tests/gemm/test_gemm_gpu.py|publish or mxfp8_out or prologue|the GEMM's BF16 prologue, its MXFP8-out and publishing epilogues"
  "exhaustive|tests/gemm/test_gemm_gpu.py|every_pickable|every tactic the GEMM can pick, against its bar"
  "boundary|tests/boundary/test_boundary_multigpu.py tests/boundary/test_boundary_dead_peer_multigpu.py tests/boundary/test_consumer_numerics.py||the all-reduce and its consumer (multi-GPU parts skip on one GPU)"
  "mixes|tests/mixes/test_boundary_mixes.py tests/mixes/test_consumer_mixes.py||the next sublayer's mixes in the consumer and the next GEMM"
  "chain|tests/model/test_chain.py tests/model/test_chain_multigpu.py tests/cli/test_cli.py tests/bench/test_bench_user_mixes.py||the model chain, the CLI end to end and the bench's user mixes kernel"
  "compile|tests/model/test_compile_gpu.py||torch.compile and CUDA graphs of the step"
  "tune|tests/bench/test_tune.py tests/bench/test_tune_invariant.py||the tune command inside the chain, and in batch-invariant mode"
  "invariant|tests/gemm/test_batch_invariant_gpu.py||batch-invariant mode: the GEMMs and the chain, every bit over M and batch-mates"
  "cute|tests/gemm/test_cute_gemm_gpu.py||the CuTe DSL GEMM (needs the hopper extra, or the bundle on the device): bar, bits, graphs, op, streams, batch invariance"
)
OPT_IN=exhaustive  # the one part `all` leaves out: name it to run it
usage() {
  echo "usage: scripts/gpu_tests.sh PART|all|--list [pytest args] (all: every part but $OPT_IN); parts:" >&2
  list >&2
}

list() {
  local entry
  for entry in "${PARTS[@]}"; do
    IFS='|' read -r name files expr what <<<"$entry"
    echo "$name|$files|$expr|$what"
  done
}

known() {  # known NAME: whether NAME is a part
  local entry
  for entry in "${PARTS[@]}"; do
    [[ ${entry%%|*} == "$1" ]] && return 0
  done
  return 1
}

run_part() {  # run_part NAME [pytest args]
  local want=$1 entry
  shift
  for entry in "${PARTS[@]}"; do
    IFS='|' read -r name files expr _ <<<"$entry"
    if [[ $name == "$want" ]]; then
      # The log of the part's last run, outside the tracked tree.
      local log="${GPU_TESTS_LOG_DIR:-out/gpu-tests}/gpu-tests-$name.log"
      mkdir -p "$(dirname "$log")"
      # shellcheck disable=SC2086  # files: a space-separated list
      "${PYTHON:-python3}" -m pytest -m "gpu or multigpu" ${expr:+-k "$expr"} -q $files "$@" \
        2>&1 | tee "$log"
      return
    fi
  done
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
if [[ $part != all ]] && ! known "$part"; then
  echo "scripts/gpu_tests.sh: unknown part '$part'" >&2
  usage
  exit 2
fi

collecting=0
for arg in "$@"; do
  [[ $arg == --collect-only || $arg == --co ]] && collecting=1
done
if [[ $collecting == 0 ]] && ! "${PYTHON:-python3}" -c \
    "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "scripts/gpu_tests.sh: no CUDA device is visible to ${PYTHON:-python3} (torch.cuda.is_available() is False): run it on a GPU machine" >&2
  exit 2
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
  [[ $name == "$OPT_IN" ]] && continue
  echo "== gpu_tests part: $name" >&2
  run_part "$name" "$@" || failed+=("$name")
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "scripts/gpu_tests.sh: failed parts: ${failed[*]}" >&2
  exit 1
fi
