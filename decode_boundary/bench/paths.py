"""The benchmarked ways to run one rank's boundary, by name: the one registry
the CLI, ``benchmarks/*.py``, the tables and the plots share.

``PATHS[name](ab)`` builds the path for boundary ``ab`` once (a baseline
dequantizes its weights and compiles its tail there) and returns a step,
``step(inputs) -> BoundaryOutputs``. ``STAGES[name](ab, step, inputs)`` gives
each kernel (or library call) of that path alone, in chain order, as
``{stage: callable}`` for the per-kernel breakdown.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from decode_boundary.gemm import mxfp8_mm
from decode_boundary.model.chain import AttentionBoundary, BoundaryInputs, BoundaryOutputs

from .baselines import CompiledStep, EagerBaseline, StrongBaseline
from .report import BASELINES  # (what fused is compared with, in order)
from .user_step import UserStep

Step = Callable[[BoundaryInputs], BoundaryOutputs]


def _ours(fused: bool, batch_invariant: bool = False) -> Callable[[AttentionBoundary], Step]:
    # V4.1's mixes on the side stream where that pays ("auto"); the timer joins them at
    # the graph's end (graph_time_us(join=...)), each step joins the one before.
    def step(ab: AttentionBoundary) -> Step:
        chain = ab.batch_invariant_twin() if batch_invariant else ab
        return functools.partial(chain, fused=fused, mixes_aside="auto")
    return step


PATHS: dict[str, Callable[[AttentionBoundary], Step]] = {
    # The strongest user-built steps (the headline baselines): the step without the
    # mixes by torch.compile max-autotune, the mixes by cuBLAS + one Triton kernel,
    # inline or (V4.1) on a side stream.
    "user_step": UserStep,
    "user_step_aside": functools.partial(UserStep, aside=True),
    "compiled_step": CompiledStep,  # the whole step by torch.compile max-autotune
    "strong_baseline": StrongBaseline,  # cuBLAS BF16 + torch.compile'd mHC / RMSNorm
    "baseline": EagerBaseline,  # cuBLAS FP8 row-wise + eager torch
    "unfused": _ours(fused=False),  # our GEMMs, the publish kernel, the consumer
    "fused": _ours(fused=True),  # the publishing wo_b: four launches
    # The same in batch-invariant mode (docs/DESIGN.md §7.1): its cost, in the same run.
    "fused_invariant": _ours(fused=True, batch_invariant=True),
}


# The paths torch.compile builds: their first call at each M compiles (max-autotune:
# and autotunes their GEMMs), tens of seconds where the rest take milliseconds.
COMPILED = ("user_step", "user_step_aside", "compiled_step", "strong_baseline")


def applies(name: str, ab: AttentionBoundary) -> bool:
    """Whether path ``name`` runs for ``ab``'s model: V4 (``collapse_pre="same"``)
    needs the next mixes for its own layer input, so it has no aside user step."""
    return not (name == "user_step_aside" and ab.config.collapse_pre == "same")


def paths_for(ab: AttentionBoundary, baselines: tuple[str, ...] = BASELINES) -> list[str]:
    """The paths of ``PATHS`` that run for ``ab``, in order: ours and those of
    ``baselines`` (names of ``BASELINES``) that apply to its model."""
    return [name for name in PATHS if applies(name, ab)
            and (name not in BASELINES or name in baselines)]


def baselines_for(ab: AttentionBoundary, baselines: tuple[str, ...] = BASELINES) -> list[str]:
    """The baselines of ``baselines`` that run for ``ab``, in ``BASELINES``' order."""
    return [name for name in BASELINES if name in baselines and applies(name, ab)]


def build(name: str, ab: AttentionBoundary) -> Step:
    """The step of path ``name`` for ``ab`` (``ValueError`` for an unknown name
    or one that does not apply to its model)."""
    if name not in PATHS:
        raise ValueError(f"path must be one of {tuple(PATHS)}, got {name!r}")
    if not applies(name, ab):
        raise ValueError(f"path {name!r} does not apply to {ab.config.name} "
                         f"(collapse_pre={ab.config.collapse_pre!r})")
    return PATHS[name](ab)


def join_all(ab: AttentionBoundary, steps: list[Step]) -> Callable[[], None]:
    """What joins the work ``steps`` leave on side streams (a capture must end
    joined; outputs are read after it): ``ab``'s aside mixes and those of any
    aside user step."""
    def join() -> None:
        ab.join_mixes()
        for step in steps:
            if isinstance(step, UserStep):
                step.join()
            elif isinstance(step, functools.partial) and \
                    isinstance(step.func, AttentionBoundary) and step.func is not ab:
                step.func.join_mixes()  # a twin's own all-reduce (fused_invariant)
    return join


def _fused_stages(ab: AttentionBoundary, step: Step, inputs: BoundaryInputs) -> dict:
    # The fused wo_b is timed without its publishing epilogue (a publish needs
    # its consumer), and publish + consume together.
    o = mxfp8_mm(ab.wo_a, inputs.attn_out)
    partial = mxfp8_mm(ab.wo_b, o)
    next_in = ab.reduce(inputs, partial)[2]
    return {
        "wo_a (grouped, BF16 in)": lambda: mxfp8_mm(ab.wo_a, inputs.attn_out),
        "wo_b (BF16 in)": lambda: mxfp8_mm(ab.wo_b, o),
        "publish + consumer (all-reduce, mHC, RMSNorm, MXFP8, next mixes)":
            lambda: ab.reduce(inputs, partial),
        "fused_wqa_wkv (MXFP8 in)": lambda: mxfp8_mm(ab.fused_wqa_wkv, next_in),
    }


def _strong_stages(ab: AttentionBoundary, strong: StrongBaseline, inputs: BoundaryInputs) -> dict:
    o = strong.project_wo_a(inputs.attn_out)
    reduced = o @ strong.wo_b.t()
    layer_input = strong.mix(reduced, inputs)[1]
    return {
        "wo_a (bmm)": lambda: strong.project_wo_a(inputs.attn_out),
        "wo_b (mm)": lambda: o @ strong.wo_b.t(),
        f"all-reduce ({strong.transport})": lambda: strong.all_reduce(reduced),
        "mHC + RMSNorm + next mixes (torch.compile)": lambda: strong.mix(reduced, inputs),
        "fused_wqa_wkv (mm)": lambda: layer_input @ strong.fused_wqa_wkv.t(),
    }


def _user_stages(ab: AttentionBoundary, step: UserStep, inputs: BoundaryInputs) -> dict:
    return step.stages(inputs)


STAGES: dict[str, Callable[..., dict[str, Callable[[], object]]]] = {
    "fused": _fused_stages,
    "user_step": _user_stages,  # the headline baseline's launches
    "strong_baseline": _strong_stages,
}
# The breakdowns that take their path's built step.
STAGE_STEPS = ("user_step", "strong_baseline")
