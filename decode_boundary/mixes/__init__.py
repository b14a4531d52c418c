"""The next sublayer's mHC mixes (docs/DESIGN.md §5.1): ``handoff`` (what an
all-reduce call returns of them, :class:`~decode_boundary.mixes.handoff.NextMixes`,
and the device arguments a consumer that left their combine hands the next
GEMM). Imports only ``common``; ``gemm/`` and ``boundary/`` build on it."""
