"""decode-boundary: the tensor-parallel attention boundary of a DeepSeek V4.1
decode step on Hopper GPUs (MXFP8 GEMMs, a Lamport all-reduce fused with mHC,
RMSNorm and MXFP8 quantization, and a wo_b GEMM that publishes from its epilogue).

The dozen names a user needs import from here (``from decode_boundary import
BoundaryAllReduce, mxfp8_mm``), in three groups:

* formats: ``QuantizedActivation`` (an MXFP8 tensor: e4m3 data + 128x4-swizzled
  UE8M0 scales), ``quantize_mxfp8`` (the Triton quantizer), ``dequantize_mxfp8``,
  ``mxfp8_scale_bytes`` (size of a scale buffer);
* GEMMs: ``Mxfp8Linear`` (an MXFP8 weight), ``load_linear`` (one projection of a
  DSV4.1 checkpoint), ``mxfp8_mm`` (the GEMM, any row count), ``precompile``
  (compile before CUDA-graph capture);
* the boundary: ``BoundaryAllReduce`` (all-reduce + mHC + RMSNorm + MXFP8),
  ``PublishingMxfp8Linear`` (``wo_b`` publishing from its epilogue),
  ``AttentionBoundary`` (one rank's whole boundary), ``MODELS`` (DSV4-family
  shapes).

They load on first use: importing the package imports no Triton. Where no
CUDA device is visible and ``TRITON_INTERPRET`` is unset, the import sets it
(``env.select_interpreter``: the kernels run on CPU tensors in Triton's
interpreter, and a warning says so once); set ``TRITON_INTERPRET=0`` first to
keep it off. Expert names stay in their
modules: ``selected_tactic`` and ``shape_representatives`` in
``decode_boundary.gemm``, ``Tactic`` and ``TABLE`` in
``decode_boundary.gemm.tactics``, ``mxfp8_mm_ref`` in
``decode_boundary.gemm.reference``, ``quantize_mxfp8_ref`` in
``decode_boundary.mxfp8.format``.

Layers (each imports only those before it in this list; docs/CONTRACTS.md,
tests/cli/test_api.py): ``mxfp8.format``, ``env`` (formats) -> ``common`` (device
helpers) -> ``mxfp8.quantize_kernel``, ``mixes`` (the next sublayer's mHC
mixes: the hand-off to the next GEMM) -> ``gemm`` (the GEMM), ``boundary``
(the all-reduce; neither imports the other) -> ``publishing_linear`` (where
the two meet) -> ``model`` (the model chain) -> ``bench`` (everything that
measures: the timer, the timeline's analysis, the per-GPU launcher, baselines,
the report, the tuner) -> ``cli``.
"""

from __future__ import annotations

import importlib

# Importing the package sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
# NVSHMEM_DISABLE_NVLS=1 (env.py, at its import): NVLink multicast is never used, and a
# process group created after this import cannot pick it up. Without a CUDA device it
# also selects Triton's interpreter, before anything imports Triton. env imports no Triton.
from . import env  # noqa: E402, F401

__version__ = "0.1.0"

_EXPORTS = {
    # formats: MXFP8 tensors, byte-compatible with FlashInfer's mm_mxfp8 operands
    "QuantizedActivation": "decode_boundary.mxfp8.format",
    "quantize_mxfp8": "decode_boundary.mxfp8.quantize_kernel",
    "dequantize_mxfp8": "decode_boundary.mxfp8.format",
    "mxfp8_scale_bytes": "decode_boundary.mxfp8.format",
    # GEMMs: MXFP8 weights and the low-row GEMM
    "Mxfp8Linear": "decode_boundary.gemm.linear",
    "load_linear": "decode_boundary.gemm.linear",
    "mxfp8_mm": "decode_boundary.gemm.api",
    "precompile": "decode_boundary.gemm.api",
    # the boundary: all-reduce + mHC + RMSNorm, the publishing wo_b, the whole chain
    "BoundaryAllReduce": "decode_boundary.boundary.all_reduce",
    "PublishingMxfp8Linear": "decode_boundary.publishing_linear",
    "AttentionBoundary": "decode_boundary.model.chain",
    "MODELS": "decode_boundary.model.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'decode_boundary' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """The user's names and ``__version__`` (each once, loaded or not); the
    submodules and helpers of this file stay out of the listing."""
    return sorted({*__all__, "__version__"})
