"""Shared builders for the GEMM tests: duck-typed MXFP8 layers and inputs
(random, or exact: integer elements whose FP32 sums are exact), and the
tactic cases every family of the tables uses."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from independent_ref import swizzle

from decode_boundary.gemm.tactics import Tactic
from decode_boundary.mxfp8.format import QuantizedActivation, quantize_mxfp8_ref


def make_layer(n: int, k: int, device="cpu", generator=None) -> SimpleNamespace:
    """An MXFP8 layer (weight = column-major [K, N] view, swizzled scales, no
    bias) of a random weight whose rows span a few binades, so group scales differ."""
    w = torch.randn(n, k, generator=generator) * torch.exp2(torch.randint(-4, 5, (n, 1),
                                                                          generator=generator))
    qw = quantize_mxfp8_ref(w.to(device))
    return SimpleNamespace(weight=qw.data.t(), weight_scale=qw.scale, bias=None)


def make_input(rows: int, k: int, device="cpu", generator=None):
    """A random MXFP8 activation [rows, K] with per-row magnitudes."""
    x = torch.randn(rows, k, generator=generator) * torch.exp2(torch.randint(-3, 4, (rows, 1),
                                                                             generator=generator))
    return quantize_mxfp8_ref(x.to(device).bfloat16())


def poisoned(rows: int, n: int, device="cpu") -> torch.Tensor:
    return torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=device)


# (rows, N, K, tactic): every family the tables use, plus the edges the kernel masks.
# Tactic(block_n, rows_tile, split_k, num_warps, chunk_k).
CASES = [
    (1, 128, 256, Tactic(8, 1, 1, 4, 256)),  # CUDA cores, one piece
    (1, 64, 1280, Tactic(4, 1, 1, 2, 512)),  # three pieces, the last one half masked
    (2, 96, 640, Tactic(16, 2, 3, 4, 128)),  # 20 groups over 3 splits: last one short
    (4, 64, 160, Tactic(8, 4, 1, 4, 64)),  # K % 64 != 0: a masked group
    (7, 48, 512, Tactic(16, 8, 2, 2, 128)),  # N not a multiple of 32, rows < tile
    (3, 128, 512, Tactic(64, 16, 2, 4, 128)),  # tensor cores at few rows
    (13, 128, 352, Tactic(32, 16, 1, 4, 128)),  # wide 16, K = 11 groups
    (29, 64, 256, Tactic(16, 32, 1, 4, 64)),  # wide 32
    (41, 64, 384, Tactic(64, 64, 3, 4, 64)),  # wide 48 as a masked 64, split-K
    (70, 64, 256, Tactic(32, 32, 2, 4, 128)),  # 3 row tiles, split-K per tile
    # Activation loads piece by piece (more than MAX_UPFRONT_BYTES_PER_THREAD held):
    (4, 16, 640, Tactic(8, 8, 1, 1, 128)),  # CUDA cores, 5 pieces, one warp
    (50, 32, 128, Tactic(32, 64, 1, 1, 64)),  # tensor cores, 2 pieces, one warp
]


def exact_layer(n, k, g, groups=1, spread=2, base=(112, 142)):
    """A layer of integer weights in [-7, 7] with per-column base scale bytes in
    ``base`` and per-group bytes base +- ``spread``."""
    w = torch.randint(-7, 8, (n, k), generator=g)
    b = torch.randint(*base, (n, 1), generator=g) + torch.randint(-spread, spread + 1,
                                                                  (n, k // 32), generator=g)
    return SimpleNamespace(weight=w.float().to(torch.float8_e4m3fn).t(),
                           weight_scale=swizzle(b.to(torch.uint8)), bias=None, groups=groups)


def exact_activation(rows, width, g, spread=2, base=(112, 142), bf16=False):
    """Integer activations in [-7, 7] times per-group powers of two (per-row base
    +- ``spread``); a few all-zero groups (scale byte 0, as a quantizer writes
    them). ``bf16``: the BF16 tensor of those values, every group holding a +-7
    so that its MXFP8 quantization is lossless (amax / 448 = 7 * 2^s / 448 is
    exactly 2^(s - 6), elements 64 * v); else the QuantizedActivation."""
    groups = width // 32
    a = torch.randint(-7, 8, (rows, groups, 32), generator=g)
    byte = torch.randint(*base, (rows, 1), generator=g) + torch.randint(-spread, spread + 1,
                                                                        (rows, groups),
                                                                        generator=g)
    zero = torch.rand(rows, groups, generator=g) < 0.1
    a[zero] = 0
    byte[zero] = 0
    if bf16:
        a[..., 5] = torch.where(torch.rand(rows, groups, generator=g) < 0.5, 7, -7)
        a[zero] = 0
        x = (a.double() * torch.exp2(byte.double() - 127)[..., None]).view(rows, width)
        x = x.to(torch.bfloat16)
        assert torch.equal(x.double(), (a.double() * torch.exp2(byte.double() - 127)[..., None])
                           .view(rows, width)), "not BF16 values"
        return x
    return QuantizedActivation(a.view(rows, width).float().to(torch.float8_e4m3fn),
                               swizzle(byte.to(torch.uint8)), torch.bfloat16,
                               torch.Size((rows, width)))
