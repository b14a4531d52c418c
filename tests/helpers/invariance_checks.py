"""Batch-invariance checks shared by the CPU (interpreter) and GPU tests: a
row's bits against the same row computed at other row counts and among other
batch-mates, for one GEMM and for the whole boundary chain. Each returns the
failures found (empty: invariant), so a test can also assert that the default
mode fails them."""

import random

import torch

from decode_boundary.gemm import mxfp8_mm
from decode_boundary.mxfp8.format import unswizzle_scales
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns of a BF16 / FP32 / byte tensor."""
    t = t.contiguous()
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def gemm_failures(layer, x: torch.Tensor, rows: list[int], bf16_input: bool, mates: int,
                  batch_invariant: bool | None, seed: int = 0) -> list[str]:
    """Rows of ``mxfp8_mm(layer, x[:m])`` against the same rows of the whole
    ``x`` (BF16 [R, K]) for every m in ``rows``, and ``mates`` single rows of
    ``x`` placed at a random position among random batch-mates of a random
    count <= R; ``bf16_input``: BF16 in (else its ``quantize_mxfp8``)."""
    def run(a):
        a = a.contiguous()
        return mxfp8_mm(layer, a if bf16_input else quantize_mxfp8(a),
                        batch_invariant=batch_invariant)

    ref = bits(run(x))
    failures = []
    for m in rows:
        got = bits(run(x[:m]))
        if not torch.equal(got, ref[:m]):
            bad = (got != ref[:m]).any(dim=1).nonzero().flatten().tolist()
            failures.append(f"M={m}: rows {bad[:6]} differ")
    rng = random.Random(seed)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    for _ in range(mates):
        m, token = rng.randint(1, x.shape[0]), rng.randrange(x.shape[0])
        at = rng.randrange(m)
        batch = (torch.randn(m, x.shape[1], generator=gen, device=x.device)
                 * x.float().std()).to(x.dtype)
        batch[at] = x[token]
        if not torch.equal(bits(run(batch))[at], ref[token]):
            failures.append(f"token {token} at row {at} of {m} batch-mates differs")
    return failures


FIELDS = ("residual_out", "layer_input", "mxfp8_data", "mxfp8_scale", "q", "next_pre",
          "next_post", "next_comb")


def chain_outputs(ab, inputs) -> dict[str, torch.Tensor]:
    """One fused boundary step (``mixes_aside="auto"``, as the bench runs it),
    every output per token: the step's, and the layer input's MXFP8 bytes
    (scales unswizzled to [M, H/32])."""
    result = ab.reduce(inputs, ab.produce(inputs, fused=True), ab.mixes_choice("auto"))
    q = mxfp8_mm(ab.fused_wqa_wkv, result.mxfp8, finish_mixes=result.mixes,
                 batch_invariant=ab.batch_invariant)
    ab.join_mixes()
    pre, post, comb = result.mixes
    out = dict(residual_out=result.residual_out, layer_input=result.layer_input,
               mxfp8_data=result.mxfp8.data,
               mxfp8_scale=unswizzle_scales(result.mxfp8.scale, inputs.rows, ab.config.hidden),
               q=q, next_pre=pre, next_post=post, next_comb=comb)
    return {name: bits(t).clone() for name, t in out.items()}


def chain_failures(ab, big, rows: list[int], mates: int, seed: int = 0) -> list[str]:
    """A token's outputs of the chain ``ab`` at every M of ``rows`` (the first
    M tokens of ``big``) and among ``mates`` random batches (a token of
    ``big`` at a random row of another step's inputs) against the same token
    in the step of all of ``big``: every bit of every output."""
    ref = chain_outputs(ab, big)
    failures = []
    for m in rows:
        got = chain_outputs(ab, big.head(m))
        bad = [f for f in FIELDS if not torch.equal(got[f], ref[f][:m])]
        if bad:
            failures.append(f"M={m}: {bad}")
    rng = random.Random(seed)
    for trial in range(mates):
        m, token = rng.randint(1, big.rows), rng.randrange(big.rows)
        at = rng.randrange(m)
        batch = ab.make_inputs(m, seed=1000 + trial)
        for name in ("attn_out", "residual", "post", "comb", "pre"):
            getattr(batch, name)[at] = getattr(big, name)[token]
        got = chain_outputs(ab, batch)
        bad = [f for f in FIELDS if not torch.equal(got[f][at], ref[f][token])]
        if bad:
            failures.append(f"token {token} at row {at} of {m}: {bad}")
    return failures
