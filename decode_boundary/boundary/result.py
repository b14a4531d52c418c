"""The one result type of a ``BoundaryAllReduce`` call."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..mixes.handoff import NextMixes
from ..mxfp8.format import QuantizedActivation


class BoundaryResult(NamedTuple):
    """What every call of a ``BoundaryAllReduce`` returns, whatever its options:
    ``residual_out`` BF16 [M, hc, H]; ``layer_input`` BF16 [M, H] (None for a
    residual-only call); ``mxfp8``, the layer input as MXFP8 in the call's
    ``mxfp8_out`` buffers (None without them); ``mixes``, the next sublayer's
    :class:`~decode_boundary.mixes.handoff.NextMixes` (None without mixes)."""

    residual_out: torch.Tensor
    layer_input: torch.Tensor | None
    mxfp8: QuantizedActivation | None
    mixes: NextMixes | None
