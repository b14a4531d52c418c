"""The README's decode-step example, transcribed for one CPU rank in the
interpreter (no process group, no CUDA graph; shapes scaled down): the calls it
documents, imported from the top-level package as it does, work together and
give the right answer, step after step.

Nothing on the reference side runs the code under test: each GEMM output is
checked against the independent FP64 product of its (independently quantized)
operands, rounded once to BF16 (tests/helpers/independent_ref.py; 1 ulp only where FP32
accumulation in the tactic's order may cross a rounding boundary); the
consumer's outputs against ``consumer_ref`` of the partial so checked
(residual_out bit for bit, layer_input within 1 ulp); the next layer's MXFP8
input against the independent quantization of layer_input, byte for byte.

The README's CPU example runs verbatim in a fresh process with no
``TRITON_INTERPRET`` set: the package's import selects the interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from independent_ref import (
    assert_mxfp8_equal,
    check_gemm,
    decode_mxfp8,
    layer_values,
    mxfp8_bytes,
    summation_depth,
)

from decode_boundary import (
    MODELS,
    AttentionBoundary,
    BoundaryAllReduce,
    Mxfp8Linear,
    PublishingMxfp8Linear,
    mxfp8_mm,
    mxfp8_scale_bytes,
)
from decode_boundary.boundary.reference import consumer_ref
from decode_boundary.gemm import selected_tactic
from decode_boundary.gemm.reference import bf16_ulp
from decode_boundary.model.checks import check_mixes, check_outputs, outputs_identical


def test_readme_decode_step_on_one_cpu_rank():
    H, HC, M, K_A, N_A = 128, 4, 8, 64, 32
    all_reduce = BoundaryAllReduce(H, HC, capacity=16, top_k=6, group=None, device="cpu",
                                   quantize_layer_input=True, residual_only=False)
    wo_a = Mxfp8Linear.grouped([Mxfp8Linear.from_float(0.02 * torch.randn(N_A, K_A))
                                for _ in range(2)])
    wo_b = Mxfp8Linear.from_float(0.02 * torch.randn(H, 2 * N_A))
    publish_wo_b = PublishingMxfp8Linear(all_reduce)
    attn = torch.randn(M, 2 * K_A).bfloat16()
    residual = torch.randn(M, HC, H).bfloat16()
    post, pre = torch.rand(M, HC), torch.rand(M, HC)
    comb = torch.rand(M, HC, HC)
    norm_weight = torch.ones(H).bfloat16()  # the RMSNorm's gamma
    norm_eps = 1e-6  # the model's rms_norm_eps
    next_in = (torch.empty(M, H, dtype=torch.float8_e4m3fn),
               torch.empty(mxfp8_scale_bytes(M, H), dtype=torch.uint8))

    def boundary():  # the README's, also returning the GEMM outputs it checks here
        o = mxfp8_mm(wo_a, attn)
        partial = publish_wo_b(wo_b, o)
        return o, partial, all_reduce(partial, residual=residual, post=post, comb=comb, pre=pre,
                                      norm_weight=norm_weight, norm_eps=norm_eps,
                                      mxfp8_out=next_in)

    publish_wo_b.precompile(wo_b, M)
    all_reduce.precompile([M])
    first = None
    for _ in range(4):  # crosses every mailbox stage
        o, partial, out = boundary()
        residual_out, layer_input = out.residual_out, out.layer_input
        assert out.mixes is None and out.mxfp8 is not None  # no mix weights; MXFP8 asked for
        check_gemm(o, decode_mxfp8(*mxfp8_bytes(attn)), layer_values(wo_a), groups=2,
                   depth=summation_depth(K_A, selected_tactic(wo_a, M)), what="wo_a",
                   min_strict=0.8)
        check_gemm(partial, decode_mxfp8(*mxfp8_bytes(o)), layer_values(wo_b),
                   depth=summation_depth(2 * N_A, selected_tactic(wo_b, M)), what="wo_b",
                   min_strict=0.8)
        want_res, want_layer, _ = consumer_ref([partial], residual, post, comb, pre,
                                               norm_weight, norm_eps)
        assert torch.equal(residual_out.view(torch.int16), want_res.view(torch.int16))
        diff = (layer_input.double() - want_layer.double()).abs()
        assert bool((diff <= bf16_ulp(want_layer.double())).all())
        assert_mxfp8_equal(next_in[0], next_in[1], layer_input)  # the next layer's input
        step = [t.view(torch.int16) for t in (o, partial, residual_out, layer_input)]
        first = first or step
        assert all(torch.equal(a, b) for a, b in zip(step, first, strict=True))
    all_reduce.check()


def test_readme_attention_boundary_on_cpu():
    """The README's simplest entry point, transcribed for the CPU (tiny model,
    interpreter): one rank's whole boundary, precompiled, then called; its
    outputs within the chain's tolerance of the pure-torch reference and its
    next mixes within MIXES_ATOL of the spec, fused and unfused bit-identical."""
    rows = int(torch.randint(1, 5, ()))
    ab = AttentionBoundary(MODELS["tiny"], tp=1, rank=0, group=None,
                           device=torch.device("cpu"), capacity=8,
                           seed=int(torch.randint(0, 1000, ())))
    ab.precompile([rows])
    inputs = ab.make_inputs(rows=rows, seed=int(torch.randint(0, 1000, ())))
    out = ab(inputs)
    assert not check_outputs(out, ab.reference(inputs))
    assert not check_mixes(out, ab)
    assert outputs_identical(out, ab(inputs, fused=False))
    ab.close()


README = Path(__file__).resolve().parents[2] / "README.md"
INTERPRETER_WARNING = "the kernels run in Triton's CPU interpreter"


def _readme_cpu_example() -> str:
    """The README's CPU block: the python block after the line that says the test
    runs it as written."""
    text = README.read_text()
    after = text.split("runs this\nblock as written", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter with no GPU visible and no TRITON_INTERPRET
    (what a user on a laptop has), the worktree's package first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(README.parent))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


def test_readme_cpu_example_runs_as_written_with_nothing_set():
    """The README's CPU block, verbatim, then the public functions on CPU tensors,
    in a fresh process: no variable set, the import selects the interpreter and
    says so once; the block prints what its comment says."""
    block = _readme_cpu_example()
    printed = block.split("print(", 1)[1].split("# ", 1)[1].splitlines()[0].strip()
    # The MXFP8 round trip within an e4m3 step (2^-3 relative, scales a power of two);
    # the GEMM within 1 % of the reference of its own operands (FP32 sums, BF16 out).
    extra = (
        "from decode_boundary import Mxfp8Linear, dequantize_mxfp8, mxfp8_mm, quantize_mxfp8\n"
        "from decode_boundary.gemm.reference import mxfp8_mm_ref\n"
        "x = torch.randn(3, 64).bfloat16()\n"
        "layer = Mxfp8Linear.from_float(torch.randn(32, 64))\n"
        "qa = quantize_mxfp8(x)\n"
        "err = (dequantize_mxfp8(qa) - x.float()).abs().max().item()\n"
        "ref = mxfp8_mm_ref(qa, layer.weight, layer.weight_scale).float()\n"
        "gemm = (mxfp8_mm(layer, qa).float() - ref).abs().max().item()\n"
        "print(err <= x.float().abs().max().item() / 8, gemm <= 0.01 * ref.abs().max().item())\n")
    done = _fresh_python(block + extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [printed, "True True"], done.stdout
    assert done.stderr.count(INTERPRETER_WARNING) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_triton_imported_first_is_told_what_to_set():
    """Triton imported before the package: too late to select the interpreter
    (Triton's own jit functions are compiled-mode already), so the package leaves
    the environment alone and names the variable to set."""
    done = _fresh_python("import os, triton, decode_boundary\n"
                         "print(os.environ.get('TRITON_INTERPRET'))\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "None"
    assert "set TRITON_INTERPRET=1 before importing Triton" in done.stderr
    assert INTERPRETER_WARNING not in done.stderr
