"""Compile the MXFP8 GEMM for sm_90 (no GPU needed) and check in the PTX what the
interpreter cannot show: where the activation is not held up front (64-row tiles),
every line of the activation slice and of its scales is prefetched into L1 right
after the grid wait, and nowhere before it; where it is held up front, nothing is
prefetched. Runs in a subprocess: the suite's ``TRITON_INTERPRET=1`` turns every
``triton.jit`` of this process into an interpreter function.
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from decode_boundary.gemm.mxfp8_gemm_kernel import mxfp8_gemm_kernel
from decode_boundary.gemm.tactics import (TABLE, activation_prefetch, activation_upfront,
                                          k_pieces)

SIG = {"w_ptr": "*fp8e4nv", "w_scale_ptr": "*u8", "a_ptr": "*fp8e4nv", "a_scale_ptr": "*u8",
       "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32",
       "peer_ptrs_ptr": "*i64", "stage_ptr": "*i32", "stamp_ptr": "*i64",
       "stamp_base": "i32", "M": "i32"}
out = {}
for name, (n, k, groups), bucket in (("wo_b_64", (5120, 2048, 1), 64),
                                     ("fused_64", (1792, 5120, 1), 64),
                                     ("wo_b_16", (5120, 2048, 1), 16)):
    t = TABLE[(n, k, groups)][bucket]
    k_slice, pieces = k_pieces(k, t)
    consts = dict(N=n, K=k, GROUPS=groups, BLOCK_N=t.block_n, ROWS=t.rows_tile,
                  SPLIT_K=t.split_k, K_SLICE=k_slice, CHUNK=t.chunk_k, PIECES=pieces,
                  A_UPFRONT=activation_upfront(t, k, False),
                  A_PREFETCH=activation_prefetch(t, k, False, True), A_BF16=False,
                  USE_PDL=True, INTERPRETER=False, PUBLISH=False, TP=1, RANK=0, CAPACITY=64,
                  HIDDEN=n, TIMELINE=False)
    sig = dict(SIG, **{c: "constexpr" for c in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, s in enumerate(sig.values()) if s[0] == "*"}
    src = ASTSource(mxfp8_gemm_kernel, sig, consts, attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": t.num_warps}).asm["ptx"]
    out[name] = {"ptx": ptx, "rows": t.rows_tile, "k_slice": k_slice, "warps": t.num_warps,
                 "prefetch": consts["A_PREFETCH"]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas to compile for sm_90")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["wo_b_64", "fused_64"])
def test_64_row_tiles_prefetch_the_whole_activation_slice_after_the_wait(compiled, name):
    kernel = compiled[name]
    assert kernel["prefetch"], "a 64-row tile should not hold its activation up front"
    before, after = kernel["ptx"].split("griddepcontrol.wait")
    assert "prefetch" not in before  # the activation is the previous kernel's output
    threads = kernel["warps"] * 32
    # Each row's slice spans k_slice / 128 (+1 unaligned) lines, its scales one line per
    # 128 K; a thread issues its share of those addresses (duplicates are allowed).
    lines = kernel["rows"] * (kernel["k_slice"] // 128 + 1)
    assert after.count("prefetch.global.L1") >= 2 * lines // threads


def test_tiles_holding_the_activation_prefetch_nothing(compiled):
    kernel = compiled["wo_b_16"]
    assert not kernel["prefetch"]
    assert "prefetch" not in kernel["ptx"]
