"""decode-boundary: the tensor-parallel attention boundary of a DeepSeek V4.1
decode step on Hopper GPUs (MXFP8 GEMMs, a Lamport all-reduce fused with mHC,
RMSNorm and MXFP8 quantization, and a wo_b GEMM that publishes from its epilogue).
"""

__version__ = "0.1.0"
