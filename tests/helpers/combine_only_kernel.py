"""A kernel that only finishes tokens' mixes (``mixes.mhc_combine``), for
tests/boundary/test_boundary_ptx.py to compile with and without FMA contraction."""

import triton
import triton.language as tl

from decode_boundary.mixes.mhc_combine import finish_token_mixes


@triton.jit
def combine_only(mix_ptr, generation_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_ptr,
                 post_ptr, comb_ptr, eps, hc_eps, rounds, wait_bound, HC: tl.constexpr,
                 HIDDEN: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
                 SLOTS: tl.constexpr, MIX_ROW: tl.constexpr, TOTALS_OFF: tl.constexpr):
    finish_token_mixes(mix_ptr, generation_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_ptr,
                       post_ptr, comb_ptr, tl.program_id(0), eps, hc_eps, rounds, wait_bound, HC,
                       HIDDEN, CHUNKS, CHUNKS_P2, SLOTS, MIX_ROW, TOTALS_OFF, True)
