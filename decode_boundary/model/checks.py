"""What the tests, ``decode-boundary verify`` and the bench check a boundary
step with: ``tp`` simulated ranks of one process (:func:`simulated_boundaries`,
:func:`run_simulated`), a path's outputs against the reference
(:func:`check_outputs`, within ``CHAIN_RTOL``), its next mixes against the spec
of its own ``residual_out`` (:func:`check_mixes`, within ``MIXES_ATOL``) and
two paths bit for bit (:func:`outputs_identical`)."""

from __future__ import annotations

import torch

from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.mixes.reference import mhc_mixes_ref
from decode_boundary.model.chain import (
    AttentionBoundary,
    BoundaryInputs,
    BoundaryOutputs,
)
from decode_boundary.model.config import BoundaryConfig

OUTPUT_NAMES = ("residual_out", "layer_input", "q")  # BoundaryOutputs' tensors (and its mixes)
MIX_NAMES = ("next_pre", "next_post", "next_comb")
# pre / post / comb against the mixes reference of the same residual_out: FP32 dots
# of length hc * H summed in another order, then sigmoid / softmax / Sinkhorn
# (tests/mixes/test_consumer_mixes.py). Against the chain's reference they are checked like
# every output (CHAIN_RTOL): its residual_out may differ by the GEMMs' last bits.
MIXES_ATOL = 1e-5


def simulated_boundaries(config: BoundaryConfig, tp: int, capacity: int, seed: int = 0,
                         device: torch.device | str = "cpu") -> list[AttentionBoundary]:
    """``tp`` ranks of one process sharing simulated mailboxes (interpreter
    runs): drive them with :func:`run_simulated`."""
    all_reduces = BoundaryAllReduce.simulated(
        tp, config.hidden, config.hc_mult, capacity, config.top_k, device=device,
        quantize_layer_input=True, residual_only=False, collapse_pre=config.collapse_pre,
        hc_eps=config.hc_eps, hc_sinkhorn_iters=config.hc_sinkhorn_iters,
    )
    return [AttentionBoundary(config, tp, rank, None, torch.device(device), capacity, seed=seed,
                              all_reduce=ar) for rank, ar in enumerate(all_reduces)]


def run_simulated(boundaries: list[AttentionBoundary], inputs: list[BoundaryInputs],
                  fused: bool = True, mixes_aside: bool | str = False
                  ) -> list[BoundaryOutputs]:
    """One step of simulated ranks: every rank produces (and publishes) first,
    then every rank consumes."""
    for b in boundaries:
        b.mixes_choice(mixes_aside)  # a bad flag is refused before any rank publishes
    partials = [b.produce(x, fused) for b, x in zip(boundaries, inputs, strict=True)]
    return [b.consume(x, p, mixes_aside)
            for b, x, p in zip(boundaries, inputs, partials, strict=True)]


# Relative L2 error allowed against the reference: each stage re-rounds to BF16
# (2^-9 relative) and MXFP8 (2^-4 per element, averaging out over K), and
# our GEMMs sum in another order than the reference, so an element near an MXFP8
# or BF16 rounding boundary can land one step away; 2e-2 bounds the whole chain.
CHAIN_RTOL = 2e-2


def check_outputs(out: BoundaryOutputs, ref: BoundaryOutputs, rtol: float = CHAIN_RTOL,
                  names: tuple = OUTPUT_NAMES + MIX_NAMES) -> list[str]:
    """Failures (empty when fine) of a path's outputs ``names`` against the reference."""
    failures = []
    for name in names:
        got, want = getattr(out, name).float(), getattr(ref, name).float()
        if got.shape != want.shape:
            failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            continue
        if not torch.isfinite(got).all():
            failures.append(f"{name}: non-finite values")
            continue
        err = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
        if err > rtol:
            failures.append(f"{name}: relative error {err:.2e} > {rtol:.0e}")
    return failures


def check_mixes(out: BoundaryOutputs, ab: AttentionBoundary,
                atol: float = MIXES_ATOL) -> list[str]:
    """Failures (empty when fine) of a path's next mixes against the spec
    (``mhc_mixes_ref``) of its own ``residual_out``, within ``atol``."""
    c = ab.config
    want = mhc_mixes_ref(out.residual_out, *ab.mix_weights, c.eps, c.hc_eps,
                         c.hc_sinkhorn_iters)
    failures = []
    for name, exp in zip(MIX_NAMES, want, strict=True):
        err = (getattr(out, name).double() - exp.double()).abs().max().item()
        if not err <= atol:  # NaN fails too
            failures.append(f"{name}: {err:.2e} from the mixes of its residual_out "
                            f"(> {atol:.0e})")
    return failures


def outputs_identical(a: BoundaryOutputs, b: BoundaryOutputs) -> bool:
    """Bit-identical outputs (BF16 and FP32 compared as raw bit patterns)."""
    return all(
        torch.equal(getattr(a, n).view(torch.int16), getattr(b, n).view(torch.int16))
        for n in OUTPUT_NAMES
    ) and all(torch.equal(getattr(a, n).view(torch.int32), getattr(b, n).view(torch.int32))
              for n in MIX_NAMES)
