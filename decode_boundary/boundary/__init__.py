"""The all-reduce of the tensor-parallel boundary (docs/DESIGN.md §5-6), by role:

* ``all_reduce``: :class:`~decode_boundary.boundary.all_reduce.BoundaryAllReduce`,
  the user's class (host rules, errors, lifetime); ``result``: what a call
  returns (``BoundaryResult``);
* what it is and what a call is: ``spec`` (the frozen ``BoundarySpec``,
  validated once at construction, and the settable ``Settings``), ``plan``
  (each call checked once into a ``StepPlan``);
* its collaborators, each taking the spec, the mailbox and the state it needs,
  never the all-reduce: ``launches`` (plan, prepare, publish, consume; the
  variants to compile), ``step_guard`` (the mailbox, a rank's step state,
  aborts, barriers, compiled variants), ``mixes_in_flight`` (mixes left on the
  side stream or to the next GEMM), ``rejection`` (the abort poison), ``ops``
  (the torch.compile custom ops and the registry of live launches);
  ``host_wait`` / ``liveness`` (bounded host waits);
* ``transport`` / ``mailbox``: the choice between peer mailboxes and an NCCL
  all-gather, and the allocation of the mailbox and device words;
* ``publish_kernel``, ``finalize_kernel``, ``consumer_kernel``: the kernels
  (the last with the ``Mode`` and ``Collapse`` enums); the consumer's host
  side: ``consumer`` (launcher: ``prepare_consume``, ``ConsumerResult``),
  ``consumer_inputs`` (what it takes and checks), ``consumer_tactics`` (the
  family's tactic tables, row thresholds and the rules that read them);
* ``reference``: the consumer's and the MoE finalize's pure-torch references.

Imports nothing of ``gemm`` (the publishing GEMM, where the two meet, is
``decode_boundary.publishing_linear``); the next mixes (their device
functions, kernel, reference and hand-off to the GEMM) are ``decode_boundary.mixes``."""
