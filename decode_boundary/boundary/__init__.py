"""The tensor-parallel boundary (docs/DESIGN.md §5-6), by role:

* ``all_reduce``: :class:`~decode_boundary.boundary.all_reduce.BoundaryAllReduce`,
  the user's class (host rules, compiling, errors, lifetime);
* ``ops``: its torch.compile custom ops and the registry of live instances;
* ``transport`` / ``mailbox``: the choice between peer mailboxes and an NCCL
  all-gather, and the allocation of the mailbox and device words;
* ``publish_kernel``, ``finalize_kernel``, ``consumer_kernel``: the kernels
  (with ``consumer``, the consumer's host side: tactics, checks, launcher);
* ``reference``: the consumer's pure-torch reference.

Imports nothing of ``gemm`` (the publishing GEMM, where the two meet, is
``decode_boundary.publishing_linear``)."""
