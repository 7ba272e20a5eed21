"""Int8 weights (WEIGHT_TYPE=INT8): the quantizer's rounding, the C kernel against a torch
dequantize-then-matmul reference (float64, within float32 rounding: the kernel sums in float32),
its batch invariance (exact: the GEMM probe finds no padding needed, and the few-row path and the
panel path give the same bits), and the switch: load, fingerprint, log line, alias, refusals."""

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import load, run
from torch import nn

from rtpkv.errors import ConfigError
from rtpkv.kernels import int8_linear
from rtpkv.kernels.int8_linear import GROUP_SIZE, PANEL_MIN_ROWS, Int8Linear, dequantize, quantize
from rtpkv.kernels.linear import PROBE_ROWS, invariant_min_rows
from conftest import needs_c_kernels

CPU = torch.device("cpu")
# (out, in, bias, group): tails of every kind: out not a multiple of 8, in not a multiple of the
# group, one group per row (per channel)
SHAPES = [(40, 64, False, 32), (37, 70, True, 32), (29, 33, False, 7), (16, 48, True, 48)]


def _linear(out_features, in_features, bias, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@needs_c_kernels
def test_the_int8_library_builds_here():
    assert int8_linear.library() is not None


def test_quantization_rounds_each_weight_to_its_nearest_step():
    w = torch.randn(24, 70, generator=torch.Generator().manual_seed(0))
    w[3, :32] = 0                                  # an all-zero group
    q, scale = quantize(w, 32)
    assert q.dtype == torch.int8 and scale.shape == (24, 3)
    assert int(q.abs().max()) == 127 and scale[3, 0] == 0
    step = scale[:, torch.arange(70) // 32]
    assert torch.all((dequantize(q, scale, 32) - w).abs() <= step / 2 * (1 + 1e-6))
    # the largest weight of each group is exact up to the scale's rounding
    assert torch.equal(q.abs().amax(dim=1), torch.full((24,), 127, dtype=torch.int8))


@pytest.mark.parametrize("rows", [1, 2, 3, PANEL_MIN_ROWS, 7, 13, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_the_dequantized_matmul(shape, rows):
    out_features, in_features, bias, group = shape
    layer = Int8Linear(_linear(out_features, in_features, bias), group)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    weight = layer.float_weight()
    q, scale = quantize(_linear(out_features, in_features, bias).weight, group)
    assert torch.equal(weight, dequantize(q, scale, group))
    bias = None if layer.bias is None else layer.bias.double()
    want = F.linear(x.double(), weight.double(), bias)
    torch.testing.assert_close(layer(x).double(), want, atol=1e-5, rtol=1e-5)


@needs_c_kernels
@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_count_gives_the_same_bits_without_padding(shape):
    out_features, in_features, bias, group = shape
    layer = Int8Linear(_linear(out_features, in_features, bias), group)
    assert invariant_min_rows(layer, in_features, torch.float32, CPU) == 1
    # the probe's row counts cross the boundary between the two paths
    assert min(PROBE_ROWS) < PANEL_MIN_ROWS <= max(PROBE_ROWS)


@needs_c_kernels
def test_few_row_and_panel_paths_give_the_same_bits():
    layer = Int8Linear(_linear(72, 96, True), GROUP_SIZE)
    x = torch.randn(3 * PANEL_MIN_ROWS, 96, generator=torch.Generator().manual_seed(2))
    together = layer(x)                                # the panel path
    for r in range(x.shape[0]):
        assert torch.equal(layer(x[r:r + 1]), together[r:r + 1])   # the few-row path


def test_int8_model_loads_quantized_with_its_own_fingerprint(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="rtpkv"):
        int8 = load(llama_path, weight_type="int8")
    layers = [m for m in int8.module.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * int8.spec.num_layers + 1 and int8.module.linear_path == "int8"
    assert int8.module.lm_head in layers and int8.dtype == torch.float32
    assert "WEIGHT_TYPE=INT8: 9 linear layers" in caplog.text and "MiB saved" in caplog.text
    assert int8.fingerprint != load(llama_path).fingerprint


def test_int8_mode_is_an_alias_and_gives_the_same_tokens(llama_path, make_pipeline, monkeypatch):
    by_name = run(make_pipeline(weight_type="INT8"), "hello what's your name", max_new_tokens=8,
                  return_logits=True)
    monkeypatch.setenv("INT8_MODE", "1")
    model = load(llama_path)
    assert model.config.weight_quantization == "int8"
    by_alias = run(make_pipeline(), "hello what's your name", max_new_tokens=8,
                   return_logits=True)
    assert by_alias.output_ids == by_name.output_ids
    assert torch.equal(by_alias.logits, by_name.logits)


def test_bad_weight_types_are_refused_by_name(llama_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"weight_type='int4' is invalid: accepted values are "
                                          r"auto, int8, w8a8_int8"):
        load(llama_path, weight_type="int4")
    monkeypatch.setenv("WEIGHT_TYPE", "FP8")
    with pytest.raises(ConfigError, match=r"WEIGHT_TYPE='FP8' is invalid"):
        load(llama_path)
    monkeypatch.setenv("WEIGHT_TYPE", "INT8")
    with pytest.raises(ConfigError, match=r"WEIGHT_TYPE=INT8 .* float32; .*dtype=bfloat16"):
        load(llama_path, dtype="bfloat16")
    monkeypatch.delenv("WEIGHT_TYPE")
    monkeypatch.setenv("INT8_MODE", "2")
    with pytest.raises(ConfigError, match=r"INT8_MODE='2' is invalid"):
        load(llama_path)
