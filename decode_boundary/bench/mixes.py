"""The next sublayer's mHC mixes measured both ways in one run (docs/DESIGN.md
§5.1): fused in our consumer, against our consumer without them followed by
what a user runs instead, compiled by ``torch.compile``.

* V4.1 (``collapse_pre="previous"``): the consumer as before (given pre), then
  ``mhc_mixes_ref`` of its ``residual_out`` (one [M, hc * H] x [hc * H,
  (2 + hc) * hc] GEMV and the scalar chain: sigmoid, softmax, Sinkhorn).
* V4 (``"same"``): the consumer residual-only, then the mixes, the collapse
  with their pre and the RMSNorm compiled as one function, then our MXFP8
  quantization of the layer input (what the next GEMM takes).

Per M (µs, cold L2 over the boundary's weight copies): ``fused`` (publish +
consumer with the mixes, as the chain runs it), ``consumer`` (publish +
today's consumer without them: the issue's yardstick), ``separate`` (the
user's tail alone) and ``consumer_then_separate`` (what a user runs in all);
V4.1 also ``mixes_kernel``: publish + consumer + our own mixes kernel after it
(``mixes.mixes_kernel``, what the chain runs beyond
``consumer_tactics.MIXES_FUSED_MAX_ROWS``), whatever M. The chain leaves the combine to
the next GEMM (``combine_mixes=False``), so the pair it runs is timed too:
``fused_with_gemm`` (publish + consumer with the mixes' shares + fused_wqa_wkv
combining them, the chain's way) against ``consumer_with_gemm`` (publish +
consumer without them + fused_wqa_wkv).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from decode_boundary.bench.timing import graph_time_us
from decode_boundary.boundary import consumer_tactics
from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.gemm import mxfp8_mm
from decode_boundary.mixes.reference import mhc_mixes_ref
from decode_boundary.model.chain import AttentionBoundary
from decode_boundary.model.checks import MIXES_ATOL
from decode_boundary.mxfp8.format import mxfp8_scale_bytes
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

from .baselines import collapse_rmsnorm


def _v4_tail(residual_out, norm_weight, eps: float, hc_fn, hc_scale, hc_base, hc_eps: float,
             iters: int):
    """V4's separate tail: (layer_input, pre, post, comb) from residual_out."""
    mixes = mhc_mixes_ref(residual_out, hc_fn, hc_scale, hc_base, eps, hc_eps, iters)
    return collapse_rmsnorm(residual_out, mixes[0], norm_weight, eps), *mixes


@contextlib.contextmanager
def fused_mixes_up_to(rows: int):
    """Inside, the consumer fuses V4.1's mixes up to ``rows`` tokens and the
    mixes kernel computes them beyond (``consumer_tactics.MIXES_FUSED_MAX_ROWS``): 0,
    the mixes kernel at any M; ``1 << 30``, fused at any M."""
    saved, consumer_tactics.MIXES_FUSED_MAX_ROWS = consumer_tactics.MIXES_FUSED_MAX_ROWS, rows
    try:
        yield
    finally:
        consumer_tactics.MIXES_FUSED_MAX_ROWS = saved


def _with_mixes_kernel(reduce, *args):
    """``reduce(*args)`` with V4.1's mixes from the mixes kernel at any M."""
    with fused_mixes_up_to(0):
        return reduce(*args)


@functools.cache
def _compiled(fn, backend: str):
    return torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)


class MixesTimer:
    """Both ways of one rank's next mixes for ``views`` (a boundary and its
    weight copies, sharing one all-reduce). Builds a second all-reduce without
    mixes over the same group (collective: every rank constructs it)."""

    def __init__(self, views: list[AttentionBoundary], rows: list[int],
                 backend: str = "inductor") -> None:
        ab = views[0]
        c = ab.config
        self.views, self.config = views, c
        self.same = c.collapse_pre == "same"
        self.plain = BoundaryAllReduce(c.hidden, c.hc_mult, ab.all_reduce.capacity, c.top_k,
                                       ab.group, quantize_layer_input=True, residual_only=True,
                                       device=ab.device)
        self.plain.precompile(rows)
        self.separate = _compiled(_v4_tail if self.same else mhc_mixes_ref, backend)

    def close(self) -> None:
        self.plain.close()

    def _tail(self, v: AttentionBoundary, residual_out: torch.Tensor):
        c = self.config
        if self.same:
            layer_input, *mixes = self.separate(residual_out, v.norm_weight, c.eps,
                                                *v.mix_weights, c.hc_eps, c.hc_sinkhorn_iters)
            return quantize_mxfp8(layer_input), mixes
        return self.separate(residual_out, *v.mix_weights, c.eps, c.hc_eps, c.hc_sinkhorn_iters)

    def _mxfp8_buffers(self, v: AttentionBoundary, rows: int):
        """(data, swizzled scales) for the MXFP8 layer input of ``rows`` tokens."""
        h = self.config.hidden
        return (torch.empty(rows, h, dtype=torch.float8_e4m3fn, device=v.device),
                torch.empty(mxfp8_scale_bytes(rows, h), dtype=torch.uint8, device=v.device))

    def _consumer(self, v: AttentionBoundary, inputs, partial, pre, mxfp8_out=None):
        """The consumer without mixes (residual-only where ``pre`` is None)."""
        if pre is not None and mxfp8_out is None:
            mxfp8_out = self._mxfp8_buffers(v, inputs.rows)
        return self.plain(partial, residual=inputs.residual, post=inputs.post, comb=inputs.comb,
                          pre=pre, norm_weight=v.norm_weight, norm_eps=self.config.eps,
                          mxfp8_out=mxfp8_out)

    def _consumer_with_gemm(self, v: AttentionBoundary, inputs, partial):
        """The consumer without mixes (given pre), then fused_wqa_wkv on its
        MXFP8 layer input: (residual_out, layer_input, q)."""
        res = self._consumer(v, inputs, partial, inputs.pre, self._mxfp8_buffers(v, inputs.rows))
        return res.residual_out, res.layer_input, mxfp8_mm(v.fused_wqa_wkv, res.mxfp8)

    @staticmethod
    def _fused_with_gemm(v: AttentionBoundary, inputs, partial):
        """The chain's consumer and fused_wqa_wkv, the combine left to the
        GEMM: (residual_out, layer_input, q, mixes)."""
        res = v.reduce(inputs, partial, mixes_placement="next_gemm")
        return res.residual_out, res.layer_input, \
            mxfp8_mm(v.fused_wqa_wkv, res.mxfp8, finish_mixes=res.mixes), tuple(res.mixes)

    def steps(self, inputs) -> dict[str, list]:
        """name -> one callable per weight copy."""
        names = ["fused", "consumer", "separate", "consumer_then_separate",
                 *([] if self.same else ["mixes_kernel"]), "fused_with_gemm",
                 "consumer_with_gemm"]
        out = {name: [] for name in names}
        for v in self.views:
            partial = mxfp8_mm(v.wo_b, mxfp8_mm(v.wo_a, inputs.attn_out))
            residual_out = v.reduce(inputs, partial)[0]
            out["fused"].append(functools.partial(v.reduce, inputs, partial))
            if not self.same:
                out["mixes_kernel"].append(functools.partial(_with_mixes_kernel, v.reduce,
                                                             inputs, partial))
            out["consumer"].append(functools.partial(self._consumer, v, inputs, partial,
                                                     inputs.pre))
            out["separate"].append(functools.partial(self._tail, v, residual_out))

            def both(v=v, partial=partial):
                pre = None if self.same else inputs.pre
                return self._tail(v, self._consumer(v, inputs, partial, pre)[0])

            out["consumer_then_separate"].append(both)
            out["fused_with_gemm"].append(
                functools.partial(self._fused_with_gemm, v, inputs, partial))
            out["consumer_with_gemm"].append(
                functools.partial(self._consumer_with_gemm, v, inputs, partial))
        return out


def check_ways(steps: dict[str, list], ab: AttentionBoundary, same: bool) -> list[str]:
    """Failures (empty when fine) of the timed ways on the first weight copy,
    run once eagerly: every way's mixes within ``MIXES_ATOL`` of the spec of
    the fused consumer's residual_out, the chain's pair (the GEMM combining)
    with the consumer's own bits, and the consumer without mixes with its
    residual_out."""
    c = ab.config
    res_out, _, _, mixes = steps["fused"][0]()
    want = mhc_mixes_ref(res_out, *ab.mix_weights, c.eps, c.hc_eps, c.hc_sinkhorn_iters)
    failures = []

    def near(name, got):
        err = max((a.double() - b.double()).abs().max().item()
                  for a, b in zip(got, want, strict=True))
        if not err <= MIXES_ATOL:  # NaN fails too
            failures.append(f"{name}: mixes {err:.2e} from the spec of residual_out")

    near("fused", mixes)
    separate = steps["separate"][0]()
    near("separate", separate[1] if same else separate)
    if "mixes_kernel" in steps:
        near("mixes_kernel", steps["mixes_kernel"][0]()[3])
    paired = steps["fused_with_gemm"][0]()[3]
    if not all(torch.equal(a.view(torch.int32), b.view(torch.int32))
               for a, b in zip(paired, mixes, strict=True)):
        failures.append("fused_with_gemm: the GEMM's combine differs from the consumer's")
    if not torch.equal(steps["consumer"][0]()[0].view(torch.int16), res_out.view(torch.int16)):
        failures.append("consumer: residual_out differs from the fused consumer's")
    return failures


def time_mixes(views: list[AttentionBoundary], rows: list[int], device, group) -> dict:
    """``{"collapse", "rows": [{"rows", "us": {fused, consumer, separate,
    consumer_then_separate[, mixes_kernel], fused_with_gemm,
    consumer_with_gemm}, "failures"}]}`` for every M of ``rows``, in one run
    (``failures``: :func:`check_ways`, before the timing)."""
    timer = MixesTimer(views, rows)
    try:
        results = []
        for m in rows:
            inputs = views[0].make_inputs(m, seed=m)
            steps = timer.steps(inputs)
            failures = check_ways(steps, views[0], timer.same)
            results.append({"rows": m, "failures": failures, "us": {
                name: graph_time_us(calls, device, group) for name, calls in steps.items()}})
    finally:
        timer.close()
    return {"collapse": views[0].config.collapse_pre, "rows": results}
