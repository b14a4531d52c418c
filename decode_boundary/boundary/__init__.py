"""The all-reduce of the tensor-parallel boundary (docs/DESIGN.md §5-6), by role:

* ``all_reduce``: :class:`~decode_boundary.boundary.all_reduce.BoundaryAllReduce`,
  the user's class (host rules, errors, lifetime); ``result``: what a call
  returns (``BoundaryResult``);
* its collaborators, each owned by an instance and using its public
  attributes only: ``launches`` (the kernel launches, the eager step paths,
  the variants to compile), ``step_guard`` (a rank's step state, aborts,
  barriers, compiled variants), ``mixes_in_flight`` (mixes left on the side
  stream or to the next GEMM), ``rejection`` (the checks before a step reaches
  a peer, the abort poison), ``ops`` (the torch.compile custom ops and the
  registry of live instances); ``host_wait`` (bounded host waits);
* ``transport`` / ``mailbox``: the choice between peer mailboxes and an NCCL
  all-gather, and the allocation of the mailbox and device words;
* ``publish_kernel``, ``finalize_kernel``, ``consumer_kernel``: the kernels;
  the consumer's host side: ``consumer`` (launcher), ``consumer_inputs``
  (what it takes and checks), ``consumer_tactics`` (its tables);
* ``reference``: the consumer's and the MoE finalize's pure-torch references.

Imports nothing of ``gemm`` (the publishing GEMM, where the two meet, is
``decode_boundary.publishing_linear``); the next mixes (their device
functions, kernel, reference and hand-off to the GEMM) are ``decode_boundary.mixes``."""
