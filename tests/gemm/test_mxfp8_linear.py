"""Mxfp8Linear: layout, lossless DeepSeek block-scale conversion, safetensors loading."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from decode_boundary.gemm.linear import Mxfp8Linear, load_linear, ue8m0_bytes
from decode_boundary.mxfp8.format import mxfp8_scale_bytes, quantize_mxfp8_ref, unswizzle_scales


def random_fp8(n, k, gen):
    """Random finite e4m3 bytes (0x7F / 0xFF are NaN)."""
    raw = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    return raw.view(torch.float8_e4m3fn)


def block_dequant(weight_fp8, block_scale):
    """The checkpoint's own meaning: element times 2^(byte - 127) of its [32, 32] block,
    built by indexing each element's block rather than expanding per row."""
    n, k = weight_fp8.shape
    rows = torch.arange(n)[:, None] // 32
    cols = torch.arange(k)[None, :] // 32
    exponent = block_scale.view(torch.uint8).long()[rows, cols].double() - 127
    return (weight_fp8.double() * torch.exp2(exponent)).float()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def test_from_float_layout_and_bytes(gen):
    n, k = 70, 96
    w = torch.randn(n, k, generator=gen).bfloat16()
    layer = Mxfp8Linear.from_float(w)
    assert (layer.in_features, layer.out_features) == (k, n)
    assert layer.weight.shape == (k, n) and layer.weight.stride() == (1, k)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.t().is_contiguous()
    assert layer.weight_scale.dtype == torch.uint8
    assert layer.weight_scale.shape == (mxfp8_scale_bytes(n, k),)
    assert layer.bias is None
    want = quantize_mxfp8_ref(w)
    assert layer.weight.t().view(torch.uint8).equal(want.data.view(torch.uint8))
    assert layer.weight_scale.equal(want.scale)
    assert dict(layer.named_buffers()).keys() == {"weight", "weight_scale"}


@pytest.mark.parametrize("n,k", [(70, 96), (32, 32), (129, 160)])
@pytest.mark.parametrize("as_e8m0", [False, True])
def test_from_block_scaled_is_bit_exact(n, k, as_e8m0, gen):
    weight = random_fp8(n, k, gen)
    block_scale = torch.randint(100, 150, (-(-n // 32), k // 32), dtype=torch.uint8, generator=gen)
    given = block_scale.view(torch.float8_e8m0fnu) if as_e8m0 else block_scale
    layer = Mxfp8Linear.from_block_scaled(weight, given)
    assert layer.dequantized_weight().equal(block_dequant(weight, block_scale))
    # The elements are kept as they are, and every 1x32 scale is its block's byte.
    assert layer.weight.t().view(torch.uint8).equal(weight.view(torch.uint8))
    scales = unswizzle_scales(layer.weight_scale, n, k)
    assert scales.equal(block_scale.repeat_interleave(32, dim=0)[:n])


def test_from_block_scaled_hand_values():
    # Rows 0 and 32 sit in different row blocks: 1.0 (0x38) * 2^(127-127) and * 2^(130-127).
    weight = torch.zeros(33, 64, dtype=torch.uint8)
    weight[0, 0] = weight[32, 0] = 0x38
    weight[32, 63] = 0xC0  # -2.0, in column block 1 whose byte is 120: -2 * 2^-7
    block_scale = torch.tensor([[127, 127], [130, 120]], dtype=torch.uint8)
    w = Mxfp8Linear.from_block_scaled(weight.view(torch.float8_e4m3fn), block_scale)
    deq = w.dequantized_weight()
    assert (deq[0, 0].item(), deq[32, 0].item(), deq[32, 63].item()) == (1.0, 8.0, -(2.0**-6))
    assert int(deq.count_nonzero()) == 3


def test_ue8m0_bytes():
    floats = torch.tensor([1.0, 0.5, 2.0**-127, 2.0**127, 2.0**-20])
    assert ue8m0_bytes(floats).tolist() == [127, 126, 0, 254, 107]
    assert ue8m0_bytes(floats.bfloat16()).tolist() == [127, 126, 0, 254, 107]
    raw = torch.tensor([3, 200], dtype=torch.uint8)
    assert ue8m0_bytes(raw).equal(raw)
    assert ue8m0_bytes(raw.view(torch.float8_e8m0fnu)).equal(raw)
    for bad in (3.0, 0.0, -1.0, math.inf, math.nan, 2.0**-128, 0.75):
        with pytest.raises(ValueError, match="powers of two"):
            ue8m0_bytes(torch.tensor([1.0, bad]), "w.scale")
    with pytest.raises(ValueError, match="UE8M0 or float"):
        ue8m0_bytes(torch.tensor([1], dtype=torch.int32))


def checkpoint(gen, n=70, k=96):
    weight = random_fp8(n, k, gen)
    block_scale = torch.randint(110, 140, (-(-n // 32), -(-k // 32)), dtype=torch.uint8,
                                generator=gen)
    return weight, block_scale, Mxfp8Linear.from_block_scaled(weight, block_scale)


def assert_same_layer(got, want):
    assert got.weight.shape == want.weight.shape
    assert got.weight.stride() == want.weight.stride()
    assert got.weight.t().view(torch.uint8).equal(want.weight.t().view(torch.uint8))
    assert got.weight_scale.equal(want.weight_scale)


@pytest.mark.parametrize("scale_format", ["uint8", "e8m0", "float32_inv"])
def test_safetensors_single_file(tmp_path, gen, scale_format):
    weight, block_scale, want = checkpoint(gen)
    if scale_format == "float32_inv":
        tensors = {"attn.wo_b.weight_scale_inv": torch.exp2(block_scale.float() - 127)}
    elif scale_format == "e8m0":
        tensors = {"attn.wo_b.scale": block_scale.view(torch.float8_e8m0fnu)}
    else:
        tensors = {"attn.wo_b.scale": block_scale}
    tensors["attn.wo_b.weight"] = weight
    tensors["attn.other.weight"] = random_fp8(32, 32, gen)
    file = tmp_path / "layer.safetensors"
    save_file(tensors, str(file))
    assert_same_layer(load_linear(file, "attn.wo_b"), want)


def test_safetensors_sharded_dir_with_index(tmp_path, gen):
    weight, block_scale, want = checkpoint(gen)
    # Weight and scale in different shards, as the index says.
    save_file({"l.wq_b.weight": weight}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"l.wq_b.scale": block_scale, "l.x.weight": weight},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {
        "l.wq_b.weight": "model-00001-of-00002.safetensors",
        "l.wq_b.scale": "model-00002-of-00002.safetensors",
        "l.x.weight": "model-00002-of-00002.safetensors",
    }}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_layer(load_linear(tmp_path, "l.wq_b"), want)
    with pytest.raises(ValueError, match="no block scale for 'l.x'"):
        load_linear(tmp_path, "l.x")


def test_safetensors_dir_without_index(tmp_path, gen):
    weight, block_scale, want = checkpoint(gen)
    save_file({"a.weight": weight}, str(tmp_path / "one.safetensors"))
    save_file({"a.scale": block_scale}, str(tmp_path / "two.safetensors"))
    assert_same_layer(load_linear(str(tmp_path), "a"), want)


def test_tensor_parallel_shards(tmp_path, gen):
    n, k = 70, 128
    weight, block_scale, _ = checkpoint(gen, n, k)
    file = tmp_path / "w.safetensors"
    save_file({"w.weight": weight, "w.scale": block_scale}, str(file))
    # Column shard (row-parallel wo_b) and a row shard ending at N = 70 (a partial block).
    got = load_linear(file, "w", cols=slice(32, 96))
    want = Mxfp8Linear.from_block_scaled(weight[:, 32:96], block_scale[:, 1:3])
    assert_same_layer(got, want)
    got = load_linear(file, "w", rows=slice(64, None))
    assert got.dequantized_weight().equal(block_dequant(weight, block_scale)[64:])
    for bad in (slice(16, 48), slice(0, 40), slice(0, 64, 2), slice(64, 32)):
        with pytest.raises(ValueError, match="rows must be a non-empty slice"):
            load_linear(file, "w", rows=bad)


def test_load_errors(tmp_path, gen):
    weight, block_scale, _ = checkpoint(gen)
    file = tmp_path / "w.safetensors"
    save_file({
        "ok.weight": weight, "ok.scale": block_scale,
        "noscale.weight": weight.clone(),
        "badscale.weight": weight.clone(), "badscale.weight_scale_inv": torch.full((3, 3), 3.0),
        "wrongshape.weight": weight.clone(), "wrongshape.scale": block_scale[:2].clone(),
        "bf16.weight": torch.zeros(64, 64, dtype=torch.bfloat16),
        "bf16.scale": torch.zeros(2, 2, dtype=torch.uint8),
    }, str(file))
    with pytest.raises(ValueError, match="no tensor 'missing.weight'"):
        load_linear(file, "missing")
    with pytest.raises(ValueError, match="looked for"):
        load_linear(file, "noscale")
    with pytest.raises(ValueError, match="badscale.weight_scale_inv must hold powers of two"):
        load_linear(file, "badscale")
    with pytest.raises(ValueError, match=r"wrongshape.scale must be \[3, 3\]"):
        load_linear(file, "wrongshape")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        load_linear(file, "bf16")
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        load_linear(tmp_path / "nope", "ok")


def test_construction_errors(gen):
    weight = random_fp8(64, 64, gen)
    scale = torch.full((2, 2), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Mxfp8Linear.from_block_scaled(weight.float(), scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        Mxfp8Linear.from_block_scaled(random_fp8(64, 80, gen), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"block_scale must be UE8M0 .* \[2, 2\]"):
        Mxfp8Linear.from_block_scaled(weight, scale[:1])
    with pytest.raises(ValueError, match=r"block_scale must be UE8M0"):
        Mxfp8Linear.from_block_scaled(weight, scale.float())
    with pytest.raises(ValueError, match="0xFF"):
        Mxfp8Linear.from_block_scaled(weight, torch.full((2, 2), 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        Mxfp8Linear.from_float(torch.zeros(2, 4, 32))
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        Mxfp8Linear.from_float(weight)
    with pytest.raises(ValueError, match="multiple of 32"):
        Mxfp8Linear.from_float(torch.zeros(4, 48))
    with pytest.raises(ValueError, match=r"weight_scale must be 1-D uint8 \[512\]"):
        Mxfp8Linear(weight, torch.zeros(100, dtype=torch.uint8))


def test_forward_delegates_to_gemm(monkeypatch, gen):
    layer = Mxfp8Linear.from_float(torch.randn(32, 64, generator=gen))
    calls = []
    import decode_boundary.gemm.linear as linear_module

    monkeypatch.setattr(linear_module, "mxfp8_mm",
                        lambda module, x: calls.append((module, x)) or "out")
    x = torch.randn(3, 64).bfloat16()
    assert layer(x) == "out" and calls == [(layer, x)]
