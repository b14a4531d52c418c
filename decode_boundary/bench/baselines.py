"""What a user can assemble today from stock parts: the baselines every
benchmark compares against (docs/DESIGN.md §8.2). The strongest, the headline,
is ``bench.user_step`` (the step without the mixes compiled, the mixes by cuBLAS
and one Triton kernel); those here stay as secondary rows. Each is built from one
rank's :class:`~decode_boundary.model.chain.AttentionBoundary` (its weights,
group and norm) and called like a path of the registry (``bench.paths``):
``baseline(inputs) -> BoundaryOutputs``.

* :class:`StrongBaseline` (``strong_baseline``): cuBLAS BF16 GEMMs on the
  dequantized weights, ``wo_a``'s groups in one ``torch.bmm``, the all-reduce
  by torch symmetric memory's one-shot kernel where the ranks share NVLink
  (NCCL otherwise; nothing with one rank), and mHC + RMSNorm + the next
  sublayer's mixes (:func:`mhc_step`) written as vectorised torch and
  compiled by ``torch.compile``.

Every baseline computes the next sublayer's mixes with the model's collapse
(V4.1: given pre; V4: the new pre), as the fused path does.
* :class:`CompiledStep` (``compiled_step``): the whole step — the same BF16
  weights, ``wo_a``'s groups in one bmm, the all-reduce (a functional
  collective), mHC + RMSNorm, ``fused_wqa_wkv`` — as one function compiled by
  ``torch.compile(mode="max-autotune-no-cudagraphs")``, autotuned once per M:
  what a ``torch.compile`` user gets with no hand-written kernel.
* :class:`EagerBaseline` (``baseline``): cuBLAS FP8 row-wise GEMMs
  (``torch._scaled_mm``), an NCCL all-reduce, and mHC / RMSNorm / MXFP8 as
  plain torch ops (:func:`all_reduce_then_mhc`).

None is bit-compatible with our path (BF16 activations and row-wise FP8 are other
numerics); they are speed baselines, checked by :func:`check_baseline`: the chain's
outputs close to the reference (``BASELINE_RTOL``, ``EAGER_RTOL``), the next mixes
those of the baseline's own ``residual_out`` (``BASELINE_MIXES_ATOL``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from decode_boundary.boundary.reference import consumer_mixes_ref, consumer_ref
from decode_boundary.env import disable_multicast, env_flag
from decode_boundary.mixes.reference import mhc_mixes_ref
from decode_boundary.model.chain import AttentionBoundary, BoundaryInputs, BoundaryOutputs
from decode_boundary.model.checks import MIXES_ATOL, OUTPUT_NAMES, check_mixes, check_outputs
from decode_boundary.mxfp8.format import E4M3_MAX

FP8_ROW_ALIGN = 16  # cuBLASLt FP8 needs every dimension a multiple of 16

# Bars of a baseline's residual_out / layer_input / q against the MXFP8 reference
# (relative error of the whole tensor), from its numerics. The BF16 baselines (strong,
# compiled) skip the MXFP8 rounding of the three GEMMs' activations (each up to 2^-4
# per element): measured 3.1-3.5 % on residual_out and 3.9-4.5 % on q (CPU, DSV4.1-Flash
# and V4-Flash at TP-4 shapes, seed 0, M = 1-16). The eager baseline also quantizes
# both operands per row to e4m3 (one scale per 4096-5120 elements, subnormals for the
# small ones): 5.9-6.5 % and 7.4-8.0 % (q at M = 2 missed the old common 8e-2 bar:
# 8.04 %). Each bar is about twice the largest measured; a wrong computation is O(1).
BASELINE_RTOL = 8e-2
EAGER_RTOL = 0.15
# A baseline's next mixes against the spec of its own residual_out. Not our kernels'
# MIXES_ATOL (1e-5): Inductor does not emulate precision casts inside a fused kernel
# (``emulate_precision_casts`` is off by default), so the compiled baselines take the
# mixes of the FP32 mix, not of its BF16 rounding, residual_out: a few 1e-3 from the
# spec at TP-4 shapes. The bound is a few times that; mixes computed wrongly are O(0.1-1).
BASELINE_MIXES_ATOL = 1e-2


def baseline_rtol(name: str) -> float:
    """The bar of the baseline path ``name`` (``bench.paths.BASELINES``)."""
    return EAGER_RTOL if name == "baseline" else BASELINE_RTOL


def baseline_mixes_atol(name: str) -> float:
    """The bar of baseline ``name``'s next mixes against the spec of its own
    residual_out: the user steps compute them from its BF16 bits (cuBLAS FP32
    + one kernel, ``bench.user_step``), so they meet our kernels' MIXES_ATOL;
    the compiled ones take Inductor's FP32 mix (``BASELINE_MIXES_ATOL``)."""
    return MIXES_ATOL if name.startswith("user_step") else BASELINE_MIXES_ATOL


def check_baseline(out: BoundaryOutputs, ref: BoundaryOutputs, ab: AttentionBoundary,
                   rtol: float, mixes_atol: float = BASELINE_MIXES_ATOL) -> list[str]:
    """Failures (empty when fine) of a baseline's step: residual_out, layer_input
    and q within ``rtol`` of the reference, and the next mixes those of its own
    residual_out (``check_mixes``: the spec within ``mixes_atol``). The mixes are
    not held to ``rtol`` against the reference's: the sigmoids and Sinkhorn rounds
    amplify residual_out's difference (eager at M = 2: next_post 11 % for 6.5 % on
    residual_out), while computing them wrongly shows against their own spec."""
    return check_outputs(out, ref, rtol, OUTPUT_NAMES) + check_mixes(out, ab, mixes_atol)


def rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization: (data [R, K], FP32 scale [R, 1])."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class RowwiseFp8Linear:
    """cuBLAS FP8 row-wise GEMM of an ``Mxfp8Linear``'s weight (re-quantized per
    output row from the dequantized MXFP8 weight)."""

    def __init__(self, linear) -> None:
        weight = linear.dequantized_weight()  # [N, K] FP32
        data, scale = rowwise_fp8(weight)
        self.weight_t = data.t()  # column-major [K, N], as _scaled_mm wants its B operand
        self.scale_t = scale.t().contiguous()  # [1, N]
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = -(-rows // FP8_ROW_ALIGN) * FP8_ROW_ALIGN
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        data, scale = rowwise_fp8(x)
        out = torch._scaled_mm(
            data, self.weight_t, scale_a=scale, scale_b=self.scale_t, out_dtype=torch.bfloat16
        )
        return out[:rows]


def all_reduce_then_mhc(partial, residual, post, comb, pre, norm_weight, eps, group, quantize,
                        mixes=None):
    """NCCL all-reduce of the BF16 partial, then the consumer's math as torch ops.

    NCCL's BF16 sum order is its own, so ``reduced`` may differ from ours in the
    last bit; the rest follows docs/DESIGN.md §5. ``mixes`` = (mix_weights,
    hc_eps, iters, same_pre): also the next sublayer's mixes from residual_out
    (returned fourth), with ``same_pre`` the collapse with their pre.
    """
    reduced = partial.clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(reduced, group=group)
    if mixes is None:
        return consumer_ref([reduced], residual, post, comb, pre, norm_weight, eps,
                            quantize=quantize)
    weights, hc_eps, iters, same_pre = mixes
    return consumer_mixes_ref([reduced], residual, post, comb, None if same_pre else pre,
                              norm_weight, eps, weights, hc_eps, iters, quantize=quantize)


def mhc_mix(reduced: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """residual_out [M, hc, H] BF16 (docs/DESIGN.md §5 step 2) as vectorised torch."""
    return (reduced.float()[:, None, :] * post[:, :, None]
            + torch.einsum("msh,mst->mth", residual.float(), comb)).bfloat16()


def collapse_rmsnorm(mixed: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """layer_input [M, H] BF16 (docs/DESIGN.md §5 step 3, same rounding points)."""
    prenorm = (mixed.float() * pre[:, :, None]).sum(dim=1).bfloat16().float()
    scale = torch.rsqrt(prenorm.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (prenorm * scale * norm_weight.float()).bfloat16()


def mhc_rmsnorm(reduced: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor, eps: float):
    """mHC + RMSNorm (docs/DESIGN.md §5 steps 2-3, same rounding points) as
    vectorised torch: (residual_out [M, hc, H], layer_input [M, H]), BF16."""
    mixed = mhc_mix(reduced, residual, post, comb)
    return mixed, collapse_rmsnorm(mixed, pre, norm_weight, eps)


def mhc_step(reduced, residual, post, comb, pre, norm_weight, eps: float, hc_fn, hc_scale,
             hc_base, hc_eps: float, iters: int, same_pre: bool):
    """mHC + RMSNorm + the next sublayer's mixes (``reference.mhc_mixes_ref``
    of residual_out) as torch: (residual_out, layer_input, pre, post, comb);
    with ``same_pre`` (V4) the collapse takes the new pre, else the given one.
    What :class:`StrongBaseline` and :class:`CompiledStep` compile."""
    mixed = mhc_mix(reduced, residual, post, comb)
    mixes = mhc_mixes_ref(mixed, hc_fn, hc_scale, hc_base, eps, hc_eps, iters)
    layer_input = collapse_rmsnorm(mixed, mixes[0] if same_pre else pre, norm_weight, eps)
    return mixed, layer_input, *mixes


def mix_args(ab: AttentionBoundary) -> tuple:
    """(hc_fn, hc_scale, hc_base, hc_eps, iters, same_pre) of ``ab``: mhc_step's tail."""
    c = ab.config
    return (*ab.mix_weights, c.hc_eps, c.hc_sinkhorn_iters, c.collapse_pre == "same")


def bf16_weights(ab: AttentionBoundary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ab``'s MXFP8 weights dequantized once to BF16: ``wo_a`` [G, N/G, K]
    (its groups stacked for one bmm), ``wo_b`` and ``fused_wqa_wkv`` [N, K]."""
    k_a, n_a = ab.wo_a.weight.shape
    groups = ab.wo_a.groups
    return (ab.wo_a.dequantized_weight().bfloat16().view(groups, n_a // groups, k_a),
            ab.wo_b.dequantized_weight().bfloat16(),
            ab.fused_wqa_wkv.dequantized_weight().bfloat16())


class StrongBaseline:
    """One rank's boundary as a careful user builds it from stock parts
    (module docstring): ``ab``'s MXFP8 ``wo_a`` (grouped), ``wo_b`` and
    ``fused_wqa_wkv`` dequantized once to BF16, its group and norm weight.

    The first call with a row count compiles the mHC step for it
    (``torch.compile``, one graph per M): make it outside any CUDA-graph
    capture (the bench's timer runs every step once eagerly first)."""

    def __init__(self, ab: AttentionBoundary, backend: str = "inductor") -> None:
        disable_multicast(ab.group)  # first: before symmetric memory or the group is touched
        self.wo_a, self.wo_b, self.fused_wqa_wkv = bf16_weights(ab)
        self.norm_weight, self.eps = ab.norm_weight, ab.config.eps
        self.mix_args = mix_args(ab)
        self.group = group = ab.group
        self.tp = dist.get_world_size(group) if group is not None else 1
        # One graph per M (dynamic=False), as a server compiles its decode graphs.
        self.mhc = torch.compile(mhc_step, dynamic=False, fullgraph=True, backend=backend)
        self.symm = None
        if self.tp > 1:
            self.transport = "nccl"
            try:
                import torch.distributed._symmetric_memory as symm_mem

                hidden = self.wo_b.shape[0]
                self.symm = symm_mem.empty(ab.all_reduce.capacity * hidden,
                                           dtype=torch.bfloat16, device=self.wo_b.device)
                symm_mem.rendezvous(self.symm, group.group_name)
                self.transport = "symm_mem one-shot"
            except Exception:  # noqa: BLE001 - no peer access: NCCL is what a user has then
                self.symm = None
        else:
            self.transport = "none (one rank)"

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return partial
        if self.symm is not None:
            buf = self.symm[: partial.numel()].view_as(partial)
            buf.copy_(partial)
            return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group.group_name)
        out = partial.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def project_wo_a(self, attn_out: torch.Tensor) -> torch.Tensor:
        """wo_a's groups in one bmm: [M, G*K] -> [M, G*N], the groups concatenated."""
        groups, _, k_a = self.wo_a.shape
        rows = attn_out.shape[0]
        a = attn_out.view(rows, groups, k_a).transpose(0, 1)  # [G, M, K]
        return torch.bmm(a, self.wo_a.transpose(1, 2)).transpose(0, 1).reshape(rows, -1)

    def mix(self, reduced: torch.Tensor, inputs: BoundaryInputs):
        """The compiled mHC + RMSNorm + next mixes of the all-reduced sum:
        (residual_out, layer_input, pre, post, comb)."""
        return self.mhc(reduced, inputs.residual, inputs.post, inputs.comb, inputs.pre,
                        self.norm_weight, self.eps, *self.mix_args)

    def __call__(self, inputs: BoundaryInputs) -> BoundaryOutputs:
        reduced = self.all_reduce(self.project_wo_a(inputs.attn_out) @ self.wo_b.t())
        residual_out, layer_input, *mixes = self.mix(reduced, inputs)
        return BoundaryOutputs(residual_out, layer_input, layer_input @ self.fused_wqa_wkv.t(),
                               *mixes)


class EagerBaseline:
    """cuBLAS FP8 row-wise twins of ``ab``'s projections (``wo_a`` one call per
    group), an NCCL all-reduce and the consumer's math as eager torch ops."""

    def __init__(self, ab: AttentionBoundary) -> None:
        disable_multicast(ab.group)  # first: its NCCL all-reduce runs over ab's group
        self.wo_a = [RowwiseFp8Linear(ab.wo_a.group(g)) for g in range(ab.wo_a.groups)]
        self.wo_b = RowwiseFp8Linear(ab.wo_b)
        self.fused_wqa_wkv = RowwiseFp8Linear(ab.fused_wqa_wkv)
        self.width = ab.config.wo_a_shape()[1]
        self.norm_weight, self.eps, self.group = ab.norm_weight, ab.config.eps, ab.group
        *weights, hc_eps, iters, same_pre = mix_args(ab)
        self.mixes = (weights, hc_eps, iters, same_pre)

    def __call__(self, inputs: BoundaryInputs) -> BoundaryOutputs:
        w = self.width
        o = torch.cat([lin(inputs.attn_out[:, g * w:(g + 1) * w])
                       for g, lin in enumerate(self.wo_a)], dim=1)
        residual_out, layer_input, _, mixes = all_reduce_then_mhc(
            self.wo_b(o), inputs.residual, inputs.post, inputs.comb, inputs.pre,
            self.norm_weight, self.eps, self.group, quantize=True, mixes=self.mixes)
        return BoundaryOutputs(residual_out, layer_input, self.fused_wqa_wkv(layer_input),
                               *mixes)


def group_name_of(group) -> str | None:
    """The name a functional collective takes for ``group``; None without peers."""
    return group.group_name if group is not None and dist.get_world_size(group) > 1 else None


def reduced_sum(attn_out, wo_a, wo_b, group_name: str | None):
    """``wo_a``'s groups in one bmm, ``wo_b``, then the all-reduce (a functional
    collective; none with ``group_name`` None): the BF16 sum [M, H]."""
    groups, _, k_a = wo_a.shape
    rows = attn_out.shape[0]
    a = attn_out.view(rows, groups, k_a).transpose(0, 1)
    o = torch.bmm(a, wo_a.transpose(1, 2)).transpose(0, 1).reshape(rows, -1)
    partial = o @ wo_b.t()
    return partial if group_name is None else funcol.all_reduce(partial, "sum", group_name)


def _whole_step(attn_out, residual, post, comb, pre, wo_a, wo_b, fused_wqa_wkv, norm_weight,
                eps: float, group_name: str | None, *mix_tail):
    """One boundary in plain torch (BF16 weights), the next mixes included
    (``mix_tail``: :func:`mix_args`): the function CompiledStep compiles."""
    residual_out, layer_input, *mixes = mhc_step(
        reduced_sum(attn_out, wo_a, wo_b, group_name), residual, post, comb, pre,
        norm_weight, eps, *mix_tail)
    return residual_out, layer_input, layer_input @ fused_wqa_wkv.t(), *mixes


def quiet_autotune() -> None:
    """Keep Inductor's max-autotune reports (per GEMM, every choice's time, and a
    JSON of choice statistics, written straight to stderr) out of this process's
    output: hundreds of lines per bench that bury its progress and its tables.
    ``DECODE_BOUNDARY_AUTOTUNE_TABLES=1`` keeps them. Both switches are Inductor
    internals (``select_algorithm.PRINT_AUTOTUNE``, read at each report, and
    ``config.max_autotune_report_choices_stats``), present in torch 2.11 to 2.13."""
    if env_flag("DECODE_BOUNDARY_AUTOTUNE_TABLES"):
        return
    from torch._inductor import config, select_algorithm

    select_algorithm.PRINT_AUTOTUNE = False
    config.max_autotune_report_choices_stats = False


@functools.cache
def compiled(fn, backend: str, mode: str | None):
    """``fn`` compiled once per (backend, mode) for every boundary copy: the
    weights are arguments, so rotating copies reuses one graph (and one
    autotuning) per M."""
    return torch.compile(fn, backend=backend, mode=mode, dynamic=False, fullgraph=True)


class CompiledStep:
    """The whole step of ``ab`` compiled by Inductor with
    ``mode="max-autotune-no-cudagraphs"`` (module docstring), on the strong
    baseline's BF16 weights. The first call per M compiles and autotunes (tens
    of seconds): make it outside any CUDA-graph capture."""

    def __init__(self, ab: AttentionBoundary, backend: str = "inductor",
                 mode: str | None = "max-autotune-no-cudagraphs") -> None:
        disable_multicast(ab.group)  # first: the functional collective runs over ab's group
        self.weights = bf16_weights(ab)
        self.norm_weight, self.eps = ab.norm_weight, ab.config.eps
        self.group_name = group_name_of(ab.group)
        self.mix_args = mix_args(ab)
        self.step = compiled(_whole_step, backend, mode if backend == "inductor" else None)

    def __call__(self, inputs: BoundaryInputs) -> BoundaryOutputs:
        return BoundaryOutputs(*self.step(
            inputs.attn_out, inputs.residual, inputs.post, inputs.comb, inputs.pre,
            *self.weights, self.norm_weight, self.eps, self.group_name, *self.mix_args))
