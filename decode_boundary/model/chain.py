"""One rank's DeepSeek V4-family attention boundary: the model chain.

``wo_a`` (one grouped GEMM over the local output groups) -> ``wo_b``
(row-parallel: this rank's partial sum) -> all-reduce + mHC + RMSNorm + MXFP8 of
the next input -> the next layer's ``fused_wqa_wkv`` (docs/DESIGN.md §1).
Called fused (``wo_b`` publishes from its epilogue through
:class:`PublishingMxfp8Linear`, so only the consumer runs after it, and
``wo_a`` hands ``wo_b`` its output as MXFP8 from its own epilogue where its
tactic allows it: four launches up to ``PUBLISH_EPILOGUE_MAX_ROWS`` rows, plus
the quantizer of the attention output above ``PROLOGUE_MAX_ROWS``; above it the
plain ``wo_b`` and the publish kernel, measured faster there) or unfused
(plain ``wo_b`` on ``wo_a``'s BF16 output, then the publish kernel); the two
must agree bit for bit, and both with :meth:`AttentionBoundary.reference`
within ``CHAIN_RTOL``. Every kernel is launched with PDL where the GPU has
it, so each weight read overlaps the previous kernel.

``tp`` fixes the per-rank shapes; the group may be smaller (one GPU running one
rank's share of a TP-``tp`` deployment: the all-reduce over a group of one).
The baselines and the benchmark harness live in ``decode_boundary.bench``.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from decode_boundary import env
from decode_boundary.boundary.all_reduce import BoundaryAllReduce, BoundaryResult
from decode_boundary.boundary.reference import consumer_mixes_ref
from decode_boundary.gemm import mxfp8_mm, mxfp8_out_in_epilogue
from decode_boundary.gemm import precompile as gemm_precompile
from decode_boundary.gemm.linear import Mxfp8Linear, load_linear
from decode_boundary.gemm.reference import mxfp8_mm_ref
from decode_boundary.model.config import BoundaryConfig
from decode_boundary.mxfp8.format import QuantizedActivation, mxfp8_scale_bytes, quantize_mxfp8_ref
from decode_boundary.publishing_linear import PublishingMxfp8Linear

WEIGHT_STD = 0.02  # synthetic weights: the scale of a trained projection's entries
# Synthetic mHC mix parameters of the next sublayer: hc_fn entries of this size give
# mixes of order 1 from unit-RMS streams (the dots are scaled by their rsqrt).
HC_FN_STD = 0.02


@dataclass
class BoundaryInputs:
    """One step's inputs on one rank. ``attn_out`` is this rank's own; the mHC
    tensors are replicated (identical on every rank, as in the model)."""

    attn_out: torch.Tensor  # [M, attn_width] bf16
    residual: torch.Tensor  # [M, hc, H] bf16
    post: torch.Tensor  # [M, hc] f32
    comb: torch.Tensor  # [M, hc, hc] f32, [source, target]
    pre: torch.Tensor  # [M, hc] f32 (the previous sublayer's; unused by V4's collapse)

    @property
    def rows(self) -> int:
        return self.attn_out.shape[0]

    def head(self, rows: int) -> BoundaryInputs:
        """The first ``rows`` tokens' inputs (contiguous copies)."""
        return BoundaryInputs(*(getattr(self, f.name)[:rows].contiguous() for f in fields(self)))


@dataclass
class BoundaryOutputs:
    residual_out: torch.Tensor  # [M, hc, H] bf16
    layer_input: torch.Tensor  # [M, H] bf16
    q: torch.Tensor  # [M, q_lora + kv_lora] bf16
    # The next sublayer's mHC mixes from residual_out (f32 [M, hc], [M, hc], [M, hc, hc]).
    next_pre: torch.Tensor
    next_post: torch.Tensor
    next_comb: torch.Tensor

    def head(self, rows: int) -> BoundaryOutputs:
        """The first ``rows`` tokens' outputs (views)."""
        return BoundaryOutputs(*(getattr(self, f.name)[:rows] for f in fields(self)))


def _random_linear(n: int, k: int, seed: int, device: torch.device) -> Mxfp8Linear:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * WEIGHT_STD).to(torch.bfloat16)
    return Mxfp8Linear.from_float(weight.to(device))

# The chain's GEMMs run the Triton twin: its epilogues (wo_a's MXFP8 hand-off, wo_b's
# publish, fused_wqa_wkv's mixes finish) keep the step at four launches, and one backend
# for the fused and unfused paths keeps their bits equal. The CuTe kernel has only the
# BF16 epilogue so far (gemm/dispatch.py).
GEMM_BACKEND = "triton"


class AttentionBoundary:
    """Weights, all-reduce and publisher of one rank's attention boundary.

    Synthetic weights are drawn from ``seed`` (rank-specific for the sharded
    ``wo_a`` / ``wo_b``, shared for the replicated ``fused_wqa_wkv``);
    ``weights_dir`` loads layer ``layer`` of a DSV4.1-format checkpoint instead
    (the rank's slice of the sharded projections; the norm weight and the mix
    parameters stay synthetic).

    Each model runs with its own mHC semantics (``config.collapse_pre``): the
    consumer also computes the next sublayer's mixes from ``residual_out``
    (``hc_fn`` etc., synthetic, replicated); V4.1 collapses with the given
    (previous) ``pre``, V4-Flash / V4-Pro with the pre just computed.

    ``batch_invariant`` (None: ``DECODE_BOUNDARY_BATCH_INVARIANT``, read at
    construction): every GEMM of the chain, the consumer and the next mixes
    run in batch-invariant mode (docs/DESIGN.md §7.1), so a token's
    ``residual_out``, ``layer_input`` (and its MXFP8 bytes), ``q`` and next
    mixes have the same bits whatever M and its batch-mates. A given
    ``all_reduce`` must run in the same mode.
    """

    def __init__(
        self,
        config: BoundaryConfig,
        tp: int,
        rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        capacity: int,
        seed: int = 0,
        weights_dir: str | None = None,
        layer: int = 0,
        all_reduce: BoundaryAllReduce | None = None,
        batch_invariant: bool | None = None,
    ) -> None:
        config.check_tp(tp)
        # Read once, here (None: the environment's DECODE_BOUNDARY_BATCH_INVARIANT).
        batch_invariant = env.batch_invariant(batch_invariant)
        if all_reduce is not None and all_reduce.batch_invariant != batch_invariant:
            raise ValueError(f"batch_invariant={batch_invariant} but the all-reduce given runs "
                             f"with batch_invariant={all_reduce.batch_invariant}")
        if all_reduce is not None and all_reduce.collapse_pre != config.collapse_pre:
            raise ValueError(f"{config.name} collapses with the {config.collapse_pre!r} pre, "
                             f"the all-reduce given with {all_reduce.collapse_pre!r}")
        self.config, self.tp, self.rank, self.group = config, tp, rank, group
        self.device = env.resolve_device(device)
        groups_local = config.o_groups // tp
        if weights_dir is None:
            n_a, k_a = config.wo_a_shape()
            self.wo_a = Mxfp8Linear.grouped([
                _random_linear(n_a, k_a, seed * 1000 + rank * 100 + g, self.device)
                for g in range(groups_local)
            ])
            n_b, k_b = config.wo_b_shape(tp)
            self.wo_b = _random_linear(n_b, k_b, seed * 1000 + rank * 100 + 99, self.device)
            n_q, k_q = config.fused_wqa_wkv_shape()
            self.fused_wqa_wkv = _random_linear(n_q, k_q, seed * 1000 + 999, self.device)
        else:
            self._load(weights_dir, layer, groups_local)
        gen = torch.Generator().manual_seed(seed * 1000 + 998)
        self.norm_weight = (1 + 0.1 * torch.randn(config.hidden, generator=gen)).to(
            dtype=torch.bfloat16, device=self.device
        )
        n_mix = (2 + config.hc_mult) * config.hc_mult
        self.mix_weights = (
            (torch.randn(n_mix, config.hc_mult * config.hidden, generator=gen) * HC_FN_STD)
            .to(self.device),
            (torch.rand(3, generator=gen) + 0.5).to(self.device),
            (torch.randn(n_mix, generator=gen) * 0.5).to(self.device),
        )
        self._owns_all_reduce = all_reduce is None
        self.all_reduce = all_reduce or _chain_all_reduce(config, group, self.device, capacity,
                                                          batch_invariant)
        self.batch_invariant = batch_invariant
        self.publisher = PublishingMxfp8Linear(self.all_reduce)

    def batch_invariant_twin(self) -> AttentionBoundary:
        """This boundary's weights on an all-reduce in batch-invariant mode
        (itself where it runs in that mode): the bench's ``fused_invariant``
        path. The twins of boundaries that share an all-reduce share one
        (created at the first twin: collective, as any construction); it is
        closed with this boundary's. The twin is not collective otherwise."""
        if self.batch_invariant:
            return self
        shared = _INVARIANT_ALL_REDUCES.get(self.all_reduce)
        if shared is None:
            shared = _chain_all_reduce(self.config, self.group, self.device,
                                       self.all_reduce.capacity, True)
            _INVARIANT_ALL_REDUCES[self.all_reduce] = shared
        twin = copy.copy(self)
        twin.all_reduce, twin.batch_invariant, twin._owns_all_reduce = shared, True, False
        twin.publisher = PublishingMxfp8Linear(shared)
        return twin

    def _load(self, weights_dir: str, layer: int, groups_local: int) -> None:
        """Layer ``layer`` of a DSV4.1 checkpoint: this rank's wo_a groups, its
        wo_b column slice, the replicated fused_wqa_wkv."""
        prefix = f"layers.{layer}.attn"
        first = self.rank * groups_local
        self.wo_a = Mxfp8Linear.grouped([
            load_linear(weights_dir, f"{prefix}.wo_a", rows=slice(g * self.config.o_lora,
                                                                    (g + 1) * self.config.o_lora))
            .to(self.device)
            for g in range(first, first + groups_local)
        ])
        k_b = self.config.wo_b_shape(self.tp)[1]
        self.wo_b = load_linear(
            weights_dir, f"{prefix}.wo_b", cols=slice(self.rank * k_b, (self.rank + 1) * k_b)
        ).to(self.device)
        self.fused_wqa_wkv = load_linear(weights_dir, f"{prefix}.fused_wqa_wkv").to(self.device)

    def precompile(self, rows_list) -> None:
        """Compile every kernel the chain runs for these row counts (GEMMs,
        publishing GEMM, publish/consume), launching nothing. Collective: call
        it on every rank before the first step, so no rank's consumer waits on
        a peer that is still compiling, and before capturing CUDA graphs."""
        rows_list = list(rows_list)
        inv = dict(batch_invariant=self.batch_invariant, backend=GEMM_BACKEND)
        gemm_precompile(self.wo_a, rows_list, bf16_input=True, **inv)  # attention output: BF16
        handoff = [r for r in rows_list if mxfp8_out_in_epilogue(self.wo_a, r, **inv)]
        gemm_precompile(self.wo_a, handoff, bf16_input=True, mxfp8_out=True,
                        **inv)  # fused: to wo_b
        gemm_precompile(self.wo_b, rows_list, bf16_input=True,
                        **inv)  # unfused: wo_a's BF16 output
        # Fused, where the publisher declines (NCCL transport, above its rows): the plain
        # wo_b on the handed-over MXFP8.
        gemm_precompile(self.wo_b, handoff, bf16_input=False, **inv)
        gemm_precompile(self.fused_wqa_wkv, rows_list, bf16_input=False,
                        **inv)  # the consumer's MXFP8
        for rows in rows_list:
            self.publisher.precompile(self.wo_b, rows)
            # The variant that finishes the consumer's mixes (consume); before the
            # all-reduce's precompile, whose barrier then covers this compile too.
            finish = self.all_reduce.deferred_finish(rows)
            if finish is not None:
                gemm_precompile(self.fused_wqa_wkv, [rows], bf16_input=False, finish_mixes=finish,
                                **inv)
        self.all_reduce.precompile(rows_list)

    def close(self) -> None:
        if self._owns_all_reduce:
            twin = _INVARIANT_ALL_REDUCES.pop(self.all_reduce, None)
            if twin is not None:
                twin.close()
            self.all_reduce.close()

    def weight_copies(self, n: int) -> list[AttentionBoundary]:
        """``n`` boundaries (this one first) with distinct weight copies sharing
        this all-reduce: timing rotates through them so L2 holds no weight."""
        copies = [self]
        for i in range(1, n):
            copies.append(
                AttentionBoundary(
                    self.config, self.tp, self.rank, self.group, self.device,
                    self.all_reduce.capacity, seed=1 + i, all_reduce=self.all_reduce,
                    batch_invariant=self.batch_invariant,
                )
            )
        return copies

    def make_inputs(self, rows: int, seed: int) -> BoundaryInputs:
        """Random inputs; the replicated ones are drawn from ``seed`` alone, so
        they are identical on every rank."""
        c = self.config
        shared = torch.Generator().manual_seed(seed)
        own = torch.Generator().manual_seed(seed * 7919 + self.rank + 1)
        attn = torch.randn(rows, c.attn_width(self.tp), generator=own)
        residual = torch.randn(rows, c.hc_mult, c.hidden, generator=shared)
        post = 2 * torch.rand(rows, c.hc_mult, generator=shared)
        comb = torch.rand(rows, c.hc_mult, c.hc_mult, generator=shared)
        # Columns sum to 1, like the Sinkhorn-normalised comb of mHC.
        comb = comb / comb.sum(dim=1, keepdim=True)
        pre = torch.rand(rows, c.hc_mult, generator=shared)
        to = dict(device=self.device)
        return BoundaryInputs(
            attn.to(torch.bfloat16).to(**to),
            residual.to(torch.bfloat16).to(**to),
            post.to(**to),
            comb.to(**to),
            pre.to(**to),
        )

    def __call__(self, inputs: BoundaryInputs, fused: bool = True,
                 mixes_aside: bool | str = False) -> BoundaryOutputs:
        """One boundary step, fused (the publishing ``wo_b``) or unfused.

        ``mixes_aside`` (where :attr:`mixes_aside_possible`: V4.1): the next
        mixes run on the all-reduce's side stream, off the chain's critical
        path (the all-reduce's ``mixes_placement="side_stream"``); the step's
        ``next_pre`` / ``next_post`` / ``next_comb`` are complete only after
        :meth:`join_mixes` (the next step joins by itself). Elsewhere (V4,
        whose collapse needs them in the consumer) it changes nothing.
        ``"auto"``: aside from ``MIXES_ASIDE_MIN_ROWS`` tokens on, where it pays
        (measured in the chain; below, the side kernel's SM time and the join
        cost more than the mixes inside the step). The layer input (so q) may
        differ from the inline path's in its last bits: the consumer without
        the mixes runs its own tactic, another sum-of-squares order."""
        self.mixes_choice(mixes_aside)  # refused before anything is published
        return self.consume(inputs, self.produce(inputs, fused), mixes_aside)

    def mixes_choice(self, mixes_aside: bool | str) -> str:
        """The all-reduce's ``mixes_placement`` for the chain's ``mixes_aside``: the
        combine left to ``fused_wqa_wkv`` ("next_gemm"), on the side stream
        where this model can ("side_stream"), or "auto" (the all-reduce picks
        by the row count where it can)."""
        if not (isinstance(mixes_aside, bool) or mixes_aside == "auto"):
            raise ValueError(f"mixes_aside must be True, False or 'auto', got {mixes_aside!r}")
        if not self.mixes_aside_possible:
            return "next_gemm"
        return "auto" if mixes_aside == "auto" else \
            "side_stream" if mixes_aside else "next_gemm"

    @property
    def mixes_aside_possible(self) -> bool:
        """Whether ``mixes_aside`` moves this model's next mixes to a side stream."""
        return self.all_reduce.side_stream_possible

    def join_mixes(self) -> None:
        """Make the current stream wait for mixes a step left aside (none: no-op)."""
        self.all_reduce.join_mixes()

    def produce(self, inputs: BoundaryInputs, fused: bool = True) -> torch.Tensor:
        """``wo_a`` and ``wo_b``; the partial is published (by ``wo_b``'s
        epilogue when ``fused``, else by the publish kernel) and waits for
        :meth:`consume`. Split from it so simulated ranks of one process can
        all publish before any consumes."""
        # One grouped GEMM. Fused, wo_a hands wo_b its output as MXFP8 where its tactic
        # owns whole scale groups (its epilogue quantizes the BF16 output, byte for
        # byte the quantizer's), so wo_b neither quantizes in its prologue nor waits
        # for a quantizer launch; unfused, wo_b takes BF16 (quantized in its
        # prologue, or by the quantizer above PROLOGUE_MAX_ROWS): the same bits.
        inv = self.batch_invariant
        handoff = fused and mxfp8_out_in_epilogue(self.wo_a, inputs.rows, batch_invariant=inv,
                                                  backend=GEMM_BACKEND)
        o = mxfp8_mm(self.wo_a, inputs.attn_out, mxfp8_out=handoff, batch_invariant=inv,
                     backend=GEMM_BACKEND)
        return self.wo_b_published(o, fused)

    def wo_b_published(self, o: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """``wo_b`` of ``o`` (BF16 [M, K], or MXFP8), published for the
        all-reduce: by the GEMM's epilogue when ``fused`` and the publisher
        takes these rows, else by the publish kernel."""
        rows = o.rows if isinstance(o, QuantizedActivation) else o.shape[0]
        if fused and self.publisher.supports(self.wo_b, rows):
            return self.publisher(self.wo_b, o)
        partial = mxfp8_mm(self.wo_b, o, batch_invariant=self.batch_invariant,
                           backend=GEMM_BACKEND)
        self.all_reduce.publish(partial)
        return partial

    def consume(self, inputs: BoundaryInputs, partial: torch.Tensor,
                mixes_aside: bool | str = False) -> BoundaryOutputs:
        """The consumer (all-reduce + mHC + RMSNorm + MXFP8 + the next mixes'
        shares) and ``fused_wqa_wkv``, whose extra programs combine the mixes
        (``mixes_placement="next_gemm"``); with ``mixes_aside`` (:meth:`__call__`) the
        mixes kernel on the side stream instead."""
        result = self.reduce(inputs, partial, self.mixes_choice(mixes_aside))
        q = mxfp8_mm(self.fused_wqa_wkv, result.mxfp8, finish_mixes=result.mixes,
                     batch_invariant=self.batch_invariant, backend=GEMM_BACKEND)
        return BoundaryOutputs(result.residual_out, result.layer_input, q, *result.mixes)

    def reduce(self, inputs: BoundaryInputs, partial: torch.Tensor,
               mixes_placement: str | None = None, *, mixes: str | None = None
               ) -> BoundaryResult:
        """The consumer alone from the published ``partial``: the all-reduce's
        :class:`BoundaryResult` (its ``mxfp8`` the next layer's input, its
        ``mixes`` the next sublayer's; ``mixes_placement``: the all-reduce's;
        ``mixes=``, its old spelling, works with a ``DeprecationWarning``)."""
        if mixes is not None:
            warnings.warn("AttentionBoundary.reduce(..., mixes=) is deprecated: pass "
                          "mixes_placement=", DeprecationWarning, stacklevel=2)
            mixes_placement = mixes
        c, rows = self.config, inputs.rows
        data = torch.empty(rows, c.hidden, dtype=torch.float8_e4m3fn, device=self.device)
        scale = torch.empty(mxfp8_scale_bytes(rows, c.hidden), dtype=torch.uint8,
                            device=self.device)
        pre = inputs.pre if c.collapse_pre == "previous" else None
        return self.all_reduce(
            partial, residual=inputs.residual, post=inputs.post, comb=inputs.comb, pre=pre,
            norm_weight=self.norm_weight, norm_eps=c.eps, mxfp8_out=(data, scale),
            mix_weights=self.mix_weights, mixes_placement=mixes_placement,
        )

    def reference_partial(self, inputs: BoundaryInputs) -> torch.Tensor:
        """This rank's ``wo_b`` partial from the pure-torch references."""
        return _mm_ref(self.wo_b, _mm_ref(self.wo_a, inputs.attn_out))

    def reference(self, inputs: BoundaryInputs,
                  partials: list[torch.Tensor] | None = None) -> BoundaryOutputs:
        """The same boundary from the pure-torch references (GEMMs in FP32 on
        MXFP8 operands, the consumer as docs/DESIGN.md §5). ``partials``: every
        rank's :meth:`reference_partial` (simulated ranks); by default they
        are gathered over the group."""
        if partials is None:
            partial = self.reference_partial(inputs)
            partials = [partial]
            ranks = dist.get_world_size(self.group) if self.group is not None else 1
            if ranks > 1:
                partials = [torch.empty_like(partial) for _ in range(ranks)]
                dist.all_gather(partials, partial, group=self.group)
        c = self.config
        residual_out, layer_input, quantized, mixes = consumer_mixes_ref(
            partials, inputs.residual, inputs.post, inputs.comb,
            inputs.pre if c.collapse_pre == "previous" else None, self.norm_weight, c.eps,
            self.mix_weights, c.hc_eps, c.hc_sinkhorn_iters, quantize=True)
        q = mxfp8_mm_ref(quantized, self.fused_wqa_wkv.weight, self.fused_wqa_wkv.weight_scale)
        return BoundaryOutputs(residual_out, layer_input, q, *mixes)


# The batch-invariant all-reduce of each chain all-reduce that has twins (batch_invariant_twin).
_INVARIANT_ALL_REDUCES: weakref.WeakKeyDictionary[BoundaryAllReduce, BoundaryAllReduce] = \
    weakref.WeakKeyDictionary()


def _chain_all_reduce(config: BoundaryConfig, group, device: torch.device, capacity: int,
                      batch_invariant: bool) -> BoundaryAllReduce:
    """The all-reduce a boundary of ``config`` runs on (collective over ``group``)."""
    return BoundaryAllReduce(
        config.hidden, config.hc_mult, capacity, config.top_k, group,
        quantize_layer_input=True, residual_only=False, device=device,
        collapse_pre=config.collapse_pre, hc_eps=config.hc_eps,
        hc_sinkhorn_iters=config.hc_sinkhorn_iters, batch_invariant=batch_invariant)


def _mm_ref(linear, x: torch.Tensor) -> torch.Tensor:
    return mxfp8_mm_ref(quantize_mxfp8_ref(x), linear.weight, linear.weight_scale, linear.groups)
