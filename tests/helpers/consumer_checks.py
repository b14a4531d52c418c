"""The consumer's output bar, checked in one place: ``residual_out`` bit for bit
equal to the reference, ``layer_input`` within one BF16 ulp of it (the
length-H sum of squares in another order and the approximate rsqrt; the
consumer kernel's docstring)."""

import torch

from decode_boundary.gemm.reference import bf16_ulp


def consumer_mismatches(residual_out, layer_input, ref_residual, ref_layer) -> torch.Tensor:
    """How many elements miss the bar (a device tensor: no host sync);
    ``layer_input`` None (a residual-only call): only ``residual_out`` counts."""
    bad = (residual_out.view(torch.int16) != ref_residual.view(torch.int16)).sum()
    if layer_input is not None:
        diff = (layer_input.float() - ref_layer.float()).abs()
        bad = bad + (diff > bf16_ulp(ref_layer.float())).sum()
    return bad


def assert_consumer_outputs(residual_out, layer_input, ref_residual, ref_layer) -> None:
    """Assert the bar, naming the output that misses it."""
    assert torch.equal(residual_out.view(torch.int16), ref_residual.view(torch.int16)), \
        "residual_out differs from the reference"
    if layer_input is not None:
        assert int(consumer_mismatches(residual_out, layer_input, ref_residual, ref_layer)) == 0, \
            "layer_input more than one BF16 ulp from the reference"
