"""Compile the boundary kernels for sm_90 (no GPU needed) and check the PTX
for what the interpreter cannot show: 16-byte unicast peer stores, volatile
16-byte mailbox polls, the %globaltimer bound, PDL, the tagged norm hand-off
(no atomics, no fences), no FMA contraction (bit-exactness) and no multicast.

Runs in a subprocess because the suite's ``TRITON_INTERPRET=1`` turns every
``triton.jit`` of this process into an interpreter function.
"""

import json
import os
import re
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from decode_boundary.boundary.consumer_kernel import consumer_kernel
from decode_boundary.boundary.finalize_kernel import finalize_publish_kernel
from decode_boundary.mixes.mixes_kernel import next_mixes_kernel
from decode_boundary.boundary.publish_kernel import publish_kernel
from decode_boundary.gemm.mxfp8_gemm_kernel import mxfp8_gemm_kernel

def ptx(fn, sig, consts, warps, fp_fusion=False):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*"}
    src = ASTSource(fn, sig, consts, attrs)
    opts = {"enable_fp_fusion": fp_fusion, "num_warps": warps}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

out = {}
out["publish"] = ptx(publish_kernel, {"x_ptr": "*bf16", "peer_ptrs_ptr": "*i64",
    "stage_ptr": "*i32", "rank": "i32", "capacity": "i32"},
    dict(TP=2, HIDDEN=5120, BLOCK_H=512, USE_PDL=True), 2)
ptrs = ["mailbox_ptr:bf16", "stage_ptr:i32", "status_ptr:i32", "generation_ptr:i32",
        "sumsq_ptr:i64", "prenorm_ptr:bf16", "residual_ptr:bf16",
        "post_ptr:fp32", "comb_ptr:fp32",
        "pre_ptr:fp32", "gamma_ptr:bf16", "out_ptr:bf16", "layer_ptr:bf16",
        "qdata_ptr:fp8e4nv", "qscale_ptr:u8", "hc_fn_ptr:fp32", "hc_scale_ptr:fp32",
        "hc_base_ptr:fp32", "mix_ptr:i64", "pre_out_ptr:fp32", "post_out_ptr:fp32",
        "comb_out_ptr:fp32", "stamp_ptr:i64"]
sig = {p.split(":")[0]: "*" + p.split(":")[1] for p in ptrs}
sig.update(stamp_base="i32", eps="fp32", hc_eps="fp32", capacity="i32", wait_bound="i64",
           sinkhorn_rounds="i32")
full = dict(TP=2, HC=4, HIDDEN=5120, BLOCK_H=512, UNITS_P2=256, MODE=2, QUANT=True, LAMPORT=True,
    COOPERATIVE=True, USE_PTX=True, USE_PDL=True, MIXES=0, SLOTS=1, MIX_ROW=1,
    TOTALS_OFF=0, CHUNKS_P2=1, MIX_WEIGHTS_EARLY=False, COMBINE=True, TIMELINE=False)
out["consumer"] = ptx(consumer_kernel, sig, full, 2)
out["consumer_serial"] = ptx(consumer_kernel, sig, dict(full, BLOCK_H=1024, COOPERATIVE=False), 4)
out["consumer_plain"] = ptx(consumer_kernel, sig, dict(full, MODE=0, QUANT=False), 2)
# The next mixes at 128 columns, 4 warps (H = 5120, hc = 4): hc_fn after the wait (as
# consumer.MIXES_TACTICS beyond 8 tokens, at 256 columns there) and, below, before it (the
# tables' tactic up to 8 tokens).
mixes = dict(full, BLOCK_H=128, SLOTS=32, MIX_ROW=80 * 32 + 32,
             TOTALS_OFF=80 * 32, CHUNKS_P2=64)
out["consumer_mixes"] = ptx(consumer_kernel, sig, dict(mixes, MIXES=1), 4)
out["consumer_same_pre"] = ptx(consumer_kernel, sig, dict(mixes, MIXES=2), 4)
out["consumer_128x4"] = ptx(consumer_kernel, sig, dict(mixes, MIXES=0), 4)  # the same, no mixes
# hc_fn held from before the grid wait (the tables' tactic up to 8 tokens).
out["consumer_mixes_early"] = ptx(consumer_kernel, sig, dict(mixes, MIXES=1,
                                                             MIX_WEIGHTS_EARLY=True), 4)
out["consumer_same_pre_early"] = ptx(consumer_kernel, sig, dict(mixes, MIXES=2,
                                                                MIX_WEIGHTS_EARLY=True), 4)
# The combine left to the next GEMM (COMBINE=False), and that GEMM (fused_wqa_wkv at M = 1,
# compiled as the launcher does: with FMA contraction) with and without its finishing programs.
out["consumer_mixes_deferred"] = ptx(consumer_kernel, sig, dict(mixes, MIXES=1,
                                                                COMBINE=False), 4)
out["consumer_same_pre_deferred"] = ptx(consumer_kernel, sig, dict(mixes, MIXES=2,
                                                                   COMBINE=False), 4)
# The next GEMM released after each program's share (ConsumerTactic.release_late).
out["consumer_mixes_release_late"] = ptx(consumer_kernel, sig, dict(
    mixes, MIXES=1, MIX_WEIGHTS_EARLY=True, COMBINE=False, RELEASE_LATE=True), 4)
gemm_sig = {"w_ptr": "*fp8e4nv", "w_scale_ptr": "*u8", "a_ptr": "*fp8e4nv", "a_scale_ptr": "*u8",
    "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32", "peer_ptrs_ptr": "*i64",
    "stage_ptr": "*i32", "stamp_ptr": "*i64", "stamp_base": "i32", "M": "i32",
    "mix_ptr": "*i64", "generation_ptr": "*i32", "status_ptr": "*i32", "hc_scale_ptr": "*fp32",
    "hc_base_ptr": "*fp32", "pre_out_ptr": "*fp32", "post_out_ptr": "*fp32",
    "comb_out_ptr": "*fp32", "mix_eps": "fp32", "hc_eps": "fp32", "mix_rounds": "i32",
    "wait_bound": "i64"}
gemm = dict(N=1536, K=5120, GROUPS=1, BLOCK_N=4, ROWS=1, SPLIT_K=1, K_SLICE=5120, CHUNK=1024,
    PIECES=5, A_UPFRONT=True, A_BF16=False, USE_PDL=True, INTERPRETER=False, PUBLISH=False,
    TP=1, RANK=0, CAPACITY=1, HIDDEN=1, TIMELINE=False, FINISH_MIXES=False, HC=1,
    MIX_HIDDEN=1, MIX_CHUNKS=1, MIX_CHUNKS_P2=1, SLOTS=1, MIX_ROW=1, TOTALS_OFF=0,
    USE_PTX=False)
out["gemm"] = ptx(mxfp8_gemm_kernel, gemm_sig, gemm, 2, fp_fusion=True)
out["gemm_finishing"] = ptx(mxfp8_gemm_kernel, gemm_sig, dict(
    gemm, FINISH_MIXES=True, HC=4, MIX_HIDDEN=5120, MIX_CHUNKS=40, MIX_CHUNKS_P2=64, SLOTS=32,
    MIX_ROW=80 * 32 + 32, TOTALS_OFF=80 * 32, USE_PTX=True), 2, fp_fusion=True)
# The mixes kernel after the consumer (mixes_kernel.py: 128 columns x 16 tokens, 4 warps).
out["mixes_kernel"] = ptx(next_mixes_kernel, {"streams_ptr": "*bf16", "hc_fn_ptr": "*fp32",
    "hc_scale_ptr": "*fp32", "hc_base_ptr": "*fp32", "generation_ptr": "*i32",
    "mix_ptr": "*i64", "status_ptr": "*i32", "pre_out_ptr": "*fp32", "post_out_ptr": "*fp32",
    "comb_out_ptr": "*fp32", "stamp_ptr": "*i64", "stamp_base": "i32", "m_total": "i32",
    "eps": "fp32", "hc_eps": "fp32",
    "sinkhorn_rounds": "i32", "wait_bound": "i64"},
    dict(HC=4, HIDDEN=5120, BLOCK_H=128, TOKENS=16, SLOTS=32, MIX_ROW=80 * 32 + 32,
         TOTALS_OFF=80 * 32, CHUNKS_P2=64, COOPERATIVE=True,
         USE_PTX=True, USE_PDL=True, TIMELINE=False), 4)
out["finalize"] = ptx(finalize_publish_kernel, {"gemm2_ptr": "*bf16", "weights_ptr": "*fp32",
    "idx_ptr": "*i32", "shared_ptr": "*bf16", "partial_ptr": "*bf16", "peer_ptrs_ptr": "*i64",
    "stage_ptr": "*i32", "rank": "i32", "capacity": "i32"},
    dict(TP=2, TOP_K=6, HIDDEN=5120, BLOCK_H=512, PUBLISH=True, USE_PDL=True), 2)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx():
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas to compile for sm_90")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_publish_stores_16_bytes_per_peer(ptx):
    for name in ("publish", "finalize"):
        code = ptx[name]
        assert "st.global.v4.b32" in code, name
        assert "griddepcontrol.wait" in code and "griddepcontrol.launch_dependents" in code


def test_consumer_polls_volatile_with_time_bound(ptx):
    code = ptx["consumer"]
    assert "ld.volatile.global.v4" in code
    assert "%globaltimer" in code
    assert "atom.global.gpu.acq_rel.or" in code  # the status word, only on a timeout
    assert "griddepcontrol.wait" in code


def test_consumer_mixes_load_hc_fn_where_the_tactic_says_and_poll_volatile(ptx):
    """With the next mixes, hc_fn is loaded after the grid wait, or before it
    with ``MIX_WEIGHTS_EARLY`` (then nothing of it after); the
    Sinkhorn rounds are a loop, not unrolled, and normalise by reciprocals
    (``rcp.approx``: a few dozen in the code, not 20 rounds' 8 each; no
    division's range checks in the rounds); the mix row is polled with volatile
    64-bit loads (with V4's same-sublayer pre by every program); no fences,
    atomics only for the status word."""
    fn_loads = 4 * 24 * 128 // (32 * 4) // 4  # 16-byte loads: 4 streams' 24 x 128 FP32

    def loads(name):  # global loads before and after the grid wait
        code = ptx[name]
        wait = code.index("griddepcontrol.wait")
        return code[:wait].count("ld.global"), code[wait:].count("ld.global")

    for name in ("consumer_mixes", "consumer_same_pre"):
        assert loads(name)[0] <= loads("consumer_128x4")[0], name  # none more before (V4: no pre)
        assert loads(name)[1] - loads("consumer_128x4")[1] >= fn_loads, name
        early = name + "_early"
        assert loads(early)[0] - loads(name)[0] >= fn_loads, early
        assert loads(name)[1] - loads(early)[1] >= fn_loads, early
    for name in ("consumer_mixes", "consumer_same_pre", "consumer_mixes_early",
                 "consumer_same_pre_early"):
        code = ptx[name]
        assert 0 < code.count("rcp.approx.ftz.f32") < 100, name
        # the 25 sums read back behind the CTA barrier: plain loads, not volatile ones
        assert len(re.findall(r"ld\.global(\.[a-z0-9]+)*\.b64", code)) >= 25, name
        assert code.count("div.full.f32") + code.count("div.rn.f32") < 40, name
        assert "ld.volatile.global.b64" in code or "ld.volatile.global.v2.b64" in code, name
        assert "fence" not in code and "membar" not in code, name
        assert all(".or." in line for line in code.splitlines() if "atom." in line), name


def test_consumer_has_no_spills_and_a_short_body(ptx):
    """The fused consumer stays register-resident and close to the plain one:
    no local memory, and per program a few thousand instructions at most (the
    last-program whole-row norm it replaced was ~7,000 at 2 warps)."""
    for name in ("consumer", "consumer_serial", "consumer_plain", "consumer_mixes",
                 "consumer_same_pre", "consumer_mixes_early", "consumer_same_pre_early",
                 "consumer_mixes_deferred", "consumer_same_pre_deferred", "gemm_finishing"):
        code = ptx[name]
        assert "ld.local" not in code and "st.local" not in code, name
    body = [line for line in ptx["consumer"].splitlines()
            if line.strip() and not line.strip().startswith(("//", ".", "$", "{", "}"))]
    assert len(body) < 2500, len(body)
    # The norm hand-off: one 64-bit store of tag + partial, 64-bit volatile polls of the
    # token's row, and neither fences nor atomics on the way (atomics only set status).
    code = ptx["consumer"]
    assert "st.global.b64" in code or "st.global.v2.b64" in code
    assert "ld.volatile.global.v2.b64" in code or "ld.volatile.global.b64" in code
    assert "fence" not in code and "membar" not in code
    assert all(".or." in line for line in code.splitlines() if "atom." in line)


def test_mixes_kernel_holds_hc_fn_from_before_the_wait_without_spills(ptx):
    """The mixes kernel loads its hc_fn columns (a weight) before the grid
    wait, so they overlap the consumer, reads residual_out only after it,
    stays in registers, and polls the shares volatile, bounded."""
    code = ptx["mixes_kernel"]
    # the dots on tensor cores: per warp (a 16 x 8 tile of the 16 x 32 output), hc_fn's
    # three BF16 parts x 4 streams x 128 / 16 k-steps
    assert code.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 3 * 4 * 8
    assert "tf32" not in code
    wait = code.index("griddepcontrol.wait")
    assert code[:wait].count("ld.global") >= 4 * 24 * 128 // (32 * 4) // 4  # 16-byte loads
    assert "ld.local" not in code and "st.local" not in code
    assert "ld.volatile.global" in code and "%globaltimer" in code
    assert "fence" not in code and "membar" not in code
    assert all(".or." in line for line in code.splitlines() if "atom." in line)


def test_the_next_gemm_combines_with_the_consumers_roundings(ptx):
    """``COMBINE=False``: the consumer keeps no combine (no Sinkhorn
    reciprocals). The GEMM that finishes the mixes keeps its FMA contraction
    (its products: the same code as without the finishing programs, so the
    same output bits), while every product of the combine is a ``mul.rn``,
    which nothing contracts into the add after it: the consumer's roundings
    (it compiles without contraction), so either kernel combines a token to
    the same bits."""
    assert "rcp.approx.ftz.f32" not in ptx["consumer_mixes_deferred"]
    assert "rcp.approx.ftz.f32" in ptx["consumer_mixes"]
    # V4 keeps its pre (4 sigmoids: one reciprocal each), not comb's Sinkhorn rounds.
    assert ptx["consumer_same_pre_deferred"].count("rcp.approx.ftz.f32") == 4
    assert ptx["consumer_same_pre"].count("rcp.approx.ftz.f32") > 4
    plain, finishing = ptx["gemm"], ptx["gemm_finishing"]
    assert finishing.count("fma.rn.f32") == plain.count("fma.rn.f32") > 0
    assert "mul.rn.f32" not in plain and finishing.count("mul.rn.f32") >= 3 * 4 + 2 * 16
    assert 0 < finishing.count("rcp.approx.ftz.f32") < 100
    assert "ld.volatile.global" in finishing and "%globaltimer" in finishing
    assert "fence" not in finishing and "membar" not in finishing


def test_release_late_releases_after_the_share(ptx):
    """``RELEASE_LATE``: the dependents are released once, after the grid wait
    and after the program's share (its second tagged 64-bit store, the norm
    partial being the first); without it right after the wait, before either."""
    for name, late in (("consumer_mixes_deferred", False), ("consumer_mixes_release_late", True)):
        lines = ptx[name].splitlines()
        (wait,) = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        (release,) = [i for i, line in enumerate(lines)
                      if "griddepcontrol.launch_dependents" in line]
        tagged = [i for i, line in enumerate(lines) if "st.global" in line and "b64" in line]
        assert len(tagged) >= 2, name
        if late:
            assert release > tagged[1] > tagged[0] > wait, name
        else:
            assert wait < release < tagged[0], name


def test_no_fma_no_multicast(ptx):
    for name, code in ptx.items():
        assert "multimem" not in code, name
    for name in ("consumer", "consumer_serial", "consumer_plain", "consumer_mixes",
                 "consumer_same_pre", "consumer_mixes_early", "consumer_same_pre_early",
                 "consumer_mixes_deferred", "consumer_same_pre_deferred",
                 "consumer_mixes_release_late"):
        assert "fma.rn.f32" not in ptx[name], name
    assert "fma.rn.f32" not in ptx["finalize"]


def test_no_register_spills(ptx, tmp_path):
    """ptxas (the SASS register allocator, which the PTX above never shows)
    spills nothing in the kernels near the 255-register limit: the mixes
    kernel holds hc_fn's BF16 parts, the consumers with the next mixes."""
    import triton.backends.nvidia as nvidia

    ptxas = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("no ptxas")
    for name in ("mixes_kernel", "consumer_mixes", "consumer_same_pre", "consumer_mixes_early",
                 "consumer_same_pre_early", "gemm_finishing"):
        src = tmp_path / f"{name}.ptx"
        src.write_text(ptx[name])
        proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", os.devnull],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        info = proc.stdout + proc.stderr
        assert "0 bytes spill stores, 0 bytes spill loads" in info, (name, info[-500:])


SASS_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, sys.argv[1])
from combine_only_kernel import combine_only

sig = {"mix_ptr": "*i64", "generation_ptr": "*i32", "status_ptr": "*i32", "hc_scale_ptr": "*fp32",
       "hc_base_ptr": "*fp32", "pre_ptr": "*fp32", "post_ptr": "*fp32", "comb_ptr": "*fp32",
       "eps": "fp32", "hc_eps": "fp32", "rounds": "i32", "wait_bound": "i64"}
consts = dict(HC=4, HIDDEN=5120, CHUNKS=40, CHUNKS_P2=64, SLOTS=32, MIX_ROW=80 * 32 + 32,
              TOTALS_OFF=80 * 32)
sig.update({k: "constexpr" for k in consts})
attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*"}
nvdisasm = os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")
out = {}
for fusion in (False, True):
    kernel = triton.compile(ASTSource(combine_only, sig, consts, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "enable_fp_fusion": fusion})
    path = os.path.join(tempfile.mkdtemp(), "k.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([nvdisasm, path], capture_output=True, text=True, check=True).stdout
    code = [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in sass.splitlines()
            if re.match(r"\s+/\*[0-9a-f]+\*/", line)]
    out[str(fusion)] = [line for line in code if re.match(r"(@!?U?P\w+\s+)?[A-Z]", line)]
print(json.dumps(out))
"""


def test_the_combine_compiles_to_the_same_sass_with_and_without_contraction():
    """The GEMM that finishes the mixes compiles with FMA contraction, the
    consumer without: the combine (mixes.mhc_combine) must come out as the
    same machine code either way, or the two would give different bits (the
    non-ftz ``ex2`` of ``tl.exp`` and the ``div.full`` of ``tl.sigmoid`` are
    expanded by ptxas with FFMAs only where contraction is allowed)."""
    import triton.backends.nvidia as nvidia

    if not os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")):
        pytest.skip("no nvdisasm")
    env = dict(os.environ, TRITON_INTERPRET="0")
    helpers = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
    proc = subprocess.run([sys.executable, "-c", SASS_SCRIPT, helpers],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sass = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(sass["True"]) > 300 and sass["True"] == sass["False"]
    assert any("MUFU.EX2" in line for line in sass["True"])
