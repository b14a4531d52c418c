"""Shared builders for the GEMM tests: duck-typed MXFP8 layers and inputs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from decode_boundary.mxfp8.format import quantize_mxfp8_ref


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
