"""The next sublayer's mHC mixes (docs/DESIGN.md §5.1), in one place:

* ``reference``: ``mhc_mixes_ref``, the spec every computation is held to;
* ``consumer_mixes``: the consumer kernel's device functions for them (its
  share of the dots, the mix weights it holds);
* ``mhc_combine``: a token's mixes combined from the shares, the one combine
  the consumer, the mixes kernel and the next GEMM's extra programs share;
* ``mixes_kernel``: the mixes as a kernel of their own after the consumer
  (V4.1, many tokens, or on the all-reduce's side stream);
* ``handoff``: what an all-reduce call returns of them (``NextMixes``) and the
  hand-off to the next GEMM (``mxfp8_mm(..., finish_mixes=)``).

Imports only ``common``; ``gemm/`` (the finishing GEMM) and ``boundary/`` (the
consumer) build on it."""
