"""Shapes of the DeepSeek V4 family's attention boundary, per tensor-parallel rank.

Values from docs/DESIGN.md §3. Where the design gives only the per-rank GEMM shape,
the model dimensions are chosen to reproduce it (marked "derived").
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
    eps: float = 1e-20

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

    def attn_width(self, tp: int) -> int:
        """Width of the attention output one rank feeds into ``wo_a``."""
        self.check_tp(tp)
        return self.n_heads // tp * self.head_dim


MODELS: dict[str, BoundaryConfig] = {
    # docs/DESIGN.md §3: H 5120, hc 4, 64 heads x 512, q_lora 1280, 8 x 1024 o-groups, top_k 6.
    "v4.1-flash": BoundaryConfig("v4.1-flash", 5120, 4, 64, 512, 1280, 512, 8, 1024, 6),
    # H 4096 (wo_b 4096 x 2048 at TP4); other widths derived like V4.1-Flash.
    "v4-flash": BoundaryConfig("v4-flash", 4096, 4, 64, 512, 1024, 512, 8, 1024, 6),
    # H 7168 (wo_b 7168 x 4096 at TP4 -> 16 o-groups); heads and q_lora derived.
    "v4-pro": BoundaryConfig("v4-pro", 7168, 4, 128, 512, 1536, 512, 16, 1024, 8),
    # Interpreter-sized stand-in with the same structure (CPU tests, `verify` without a GPU).
    "tiny": BoundaryConfig("tiny", 256, 4, 8, 64, 128, 128, 4, 128, 2),
}
