"""The tensor-parallel boundary: Lamport mailbox, publish / consumer / finalize
kernels, :class:`~decode_boundary.boundary.all_reduce.BoundaryAllReduce`, its
references, and the publishing GEMM. Import the submodules directly."""
