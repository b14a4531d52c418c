"""What every launcher does with a kernel it compiled ahead (``compile_only``)."""

from __future__ import annotations


def load_module(compiled) -> None:
    """Load a kernel compiled by ``warmup`` onto the current device now (Triton
    loads lazily, at the first launch, which may otherwise fall in a capture)."""
    compiled.run  # noqa: B018 - the property loads the module on first access
