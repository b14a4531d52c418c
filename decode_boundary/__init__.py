"""decode-boundary: the tensor-parallel attention boundary of a DeepSeek V4.1
decode step on Hopper GPUs (MXFP8 GEMMs, a Lamport all-reduce fused with mHC,
RMSNorm and MXFP8 quantization, and a wo_b GEMM that publishes from its epilogue).

The names a user needs import from here (``from decode_boundary import
BoundaryAllReduce, mxfp8_mm``). They load on first use: importing the package
imports no Triton, so ``TRITON_INTERPRET`` can still be set after it.

Layers (each imports only those before it in this list; docs/CONTRACTS.md,
tests/test_api.py): ``mxfp8.format``, ``env`` (formats) -> ``common`` (device
helpers) -> ``mxfp8.quantize_kernel`` -> ``gemm``, ``boundary`` (kernels and
their classes; neither imports the other) -> ``publishing_linear`` (where the
two meet), ``launch``, ``report`` -> ``model`` -> ``cli``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # formats
    "QuantizedActivation": "decode_boundary.mxfp8.format",
    "dequantize_mxfp8": "decode_boundary.mxfp8.format",
    "quantize_mxfp8_ref": "decode_boundary.mxfp8.format",
    "mxfp8_scale_bytes": "decode_boundary.mxfp8.format",
    "quantize_mxfp8": "decode_boundary.mxfp8.quantize_kernel",
    # GEMMs
    "Mxfp8Linear": "decode_boundary.gemm.linear",
    "load_linear": "decode_boundary.gemm.linear",
    "mxfp8_mm": "decode_boundary.gemm.api",
    "mxfp8_mm_ref": "decode_boundary.gemm.reference",
    "low_latency_mm": "decode_boundary.gemm.api",
    "wide_mm": "decode_boundary.gemm.api",
    "pinned_mm": "decode_boundary.gemm.api",
    "wide_or_pinned_mm": "decode_boundary.gemm.api",
    "projection_mm": "decode_boundary.gemm.api",
    "precompile": "decode_boundary.gemm.api",
    "compile_pinned": "decode_boundary.gemm.api",
    "run_zeros": "decode_boundary.gemm.api",
    "shape_representatives": "decode_boundary.gemm.api",
    "selected_tactic": "decode_boundary.gemm.api",
    "AUTOTUNER": "decode_boundary.gemm.autotune",
    "pinned_tactics": "decode_boundary.gemm.autotune",
    "Tactic": "decode_boundary.gemm.tactics",
    # the boundary
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
    return sorted([*globals(), *__all__])
