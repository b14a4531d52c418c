"""Shapes of the DeepSeek V4 family's attention boundary, per tensor-parallel rank.

Values from docs/DESIGN.md §3 and the released configs (sources above ``MODELS``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BoundaryConfig:
    """One attention boundary: ``wo_a`` (per output group) -> ``wo_b`` (row-parallel,
    partial sums) -> all-reduce + mHC + RMSNorm (+ MXFP8) -> next layer's
    ``fused_wqa_wkv`` (replicated)."""

    name: str
    hidden: int
    hc_mult: int
    n_heads: int
    head_dim: int
    q_lora: int
    kv_lora: int
    o_groups: int
    o_lora: int
    top_k: int
    eps: float = 1e-20  # rms_norm_eps: the layer input's RMSNorm, and the mixes' rsqrt
    hc_eps: float = 1e-6  # mHC: added to pre, to comb and to every Sinkhorn sum
    hc_sinkhorn_iters: int = 20  # mHC: Sinkhorn rounds of comb
    # The collapse of a sublayer's input (docs/DESIGN.md §5.1): "previous" (V4.1: the
    # pre of the sublayer before, a consumer input) or "same" (V4: the pre computed
    # from the new residual_out).
    collapse_pre: str = "previous"

    def __post_init__(self) -> None:
        if self.collapse_pre not in ("previous", "same"):
            raise ValueError(f"collapse_pre must be 'previous' or 'same', got "
                             f"{self.collapse_pre!r}")

    def check_tp(self, tp: int) -> None:
        if tp < 1 or self.o_groups % tp or self.n_heads % tp:
            raise ValueError(
                f"tp={tp} must divide o_groups={self.o_groups} and n_heads={self.n_heads} "
                f"of {self.name}"
            )

    def wo_a_shape(self) -> tuple[int, int]:
        """(N, K) of one output group's ``wo_a``: heads of the group x head_dim -> o_lora."""
        return self.o_lora, self.n_heads // self.o_groups * self.head_dim

    def wo_b_shape(self, tp: int) -> tuple[int, int]:
        """(N, K) of ``wo_b`` on one rank: the rank's groups' o_lora -> hidden."""
        self.check_tp(tp)
        return self.hidden, self.o_groups // tp * self.o_lora

    def fused_wqa_wkv_shape(self) -> tuple[int, int]:
        """(N, K) of the replicated ``fused_wqa_wkv``: hidden -> q_lora + kv_lora."""
        return self.q_lora + self.kv_lora, self.hidden

    def wq_b_shape(self, tp: int) -> tuple[int, int]:
        """(N, K) of ``wq_b`` on one rank: q_lora -> the rank's heads."""
        self.check_tp(tp)
        return self.n_heads // tp * self.head_dim, self.q_lora

    def projection_shapes(self, tp: int) -> dict[str, tuple[int, int, int]]:
        """(N, K, groups) of every MXFP8 projection one rank runs at TP ``tp``, by
        name: the rank's ``wo_a`` groups as one grouped launch (as the chain runs
        them), ``wo_b``, ``fused_wqa_wkv`` and ``wq_b``. The one source of the
        shapes the GEMM table, the tuner and the tests use."""
        self.check_tp(tp)
        groups = self.o_groups // tp
        n, k = self.wo_a_shape()
        return {"wo_a": (n * groups, k, groups), "wo_b": (*self.wo_b_shape(tp), 1),
                "fused_wqa_wkv": (*self.fused_wqa_wkv_shape(), 1),
                "wq_b": (*self.wq_b_shape(tp), 1)}

    def attn_width(self, tp: int) -> int:
        """Width of the attention output one rank feeds into ``wo_a``."""
        self.check_tp(tp)
        return self.n_heads // tp * self.head_dim


# Sources, in words: V4.1-Flash from docs/DESIGN.md §3 (its released config: rms_norm_eps
# 1e-20, hc_mult 4, hc_eps 1e-6, 20 Sinkhorn rounds, V4.1's collapse with the previous
# sublayer's pre). V4-Pro from its released config.json (hidden 7168, 128 heads of 512,
# q_lora 1536, 16 o-groups of rank 1024, num_experts_per_tok 6, rms_norm_eps 1e-6,
# hc_mult 4, hc_eps 1e-6, hc_sinkhorn_iters 20). V4-Flash from its released config.json
# as a public field-by-field comparison with V4-Pro's reports it (hidden 4096, 64 heads,
# q_lora 1024, 8 o-groups; every other field above, rms_norm_eps 1e-6 and top_k 6
# included, equal to V4-Pro's). Both V4 models collapse with the same sublayer's pre.
MODELS: dict[str, BoundaryConfig] = {
    "v4.1-flash": BoundaryConfig("v4.1-flash", 5120, 4, 64, 512, 1280, 512, 8, 1024, 6),
    "v4-flash": BoundaryConfig("v4-flash", 4096, 4, 64, 512, 1024, 512, 8, 1024, 6, eps=1e-6,
                               collapse_pre="same"),
    "v4-pro": BoundaryConfig("v4-pro", 7168, 4, 128, 512, 1536, 512, 16, 1024, 6, eps=1e-6,
                             collapse_pre="same"),
    # Interpreter-sized stand-in with the same structure (CPU tests, `verify` without a GPU).
    "tiny": BoundaryConfig("tiny", 256, 4, 8, 64, 128, 128, 4, 128, 2),
}
