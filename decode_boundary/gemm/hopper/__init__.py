"""The CuTe DSL fast path of the MXFP8 GEMM on Hopper (sm_90a).

``tactics.py`` (plain Python: what the dispatch reads) — the tactics, their
fit and the tables; ``mxfp8_wgmma_kernel.py`` — the kernel; ``launcher.py`` —
its compile cache and call. Importing this package imports neither the DSL nor
Triton: only ``launcher`` (and the kernel) import the DSL, and
``gemm/dispatch.py`` imports them only once it has decided the path can run.
The Triton kernel (``gemm/mxfp8_gemm_kernel.py``) is the twin: same contract,
the path the CPU suite runs and the fallback elsewhere.
"""
