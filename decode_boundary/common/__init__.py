"""Device helpers shared by the GEMM and boundary kernels: ``rounding`` (BF16
and MXFP8 rounding, the scale swizzle) and ``mailbox_store`` (the store every
mailbox publisher makes). They import nothing of this package but its formats."""
