"""The tensor-parallel boundary: Lamport mailbox, publish / consumer / finalize
kernels, :class:`~decode_boundary.boundary.all_reduce.BoundaryAllReduce` and
its references. Imports nothing of ``gemm`` (the publishing GEMM, where the
two meet, is ``decode_boundary.publishing_linear``)."""
