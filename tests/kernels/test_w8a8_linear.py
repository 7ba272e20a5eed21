"""Int8 weights and activations (WEIGHT_TYPE=W8A8_INT8): the activation quantizer's rule, the C
kernel against its torch reference (exact: the integer sums are exact in float32, the groups are
added in the same order), batch invariance (every row count, both tile kinds, no padding), the
packing's round trip, closeness to the float layer, and the switch: load, fingerprint, log line,
the fused decoder, the weight-only modes' neighbour."""

import logging

import pytest
import torch
from conftest import load, needs_c_kernels, run
from torch import nn

from rtpkv.kernels import w8a8_linear
from rtpkv.kernels.int8_linear import GROUP_SIZE, quantize
from rtpkv.kernels.linear import invariant_min_rows
from rtpkv.kernels.w8a8_linear import (MANY_ROWS_FROM, W8A8Linear, quantize_activations,
                                       reference)

CPU = torch.device("cpu")
# (out, in, bias): out not a multiple of the 32-channel tile, in not a multiple of the group,
# in smaller than one group, whole tiles and groups
SHAPES = [(40, 64, False), (37, 70, True), (29, 20, False), (64, 96, True), (8, 33, True)]


def _linear(out_features, in_features, bias, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def _x(rows, in_features, seed=1):
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[0, :GROUP_SIZE] = 0            # a group of zeros: scale 0
    return x


@needs_c_kernels
def test_the_w8a8_library_builds_here():
    assert w8a8_linear.library() is not None


def test_activations_round_to_the_nearest_step_of_their_group():
    x = _x(3, 70)
    x[1, 5] = 1e3                                   # an outlier owns its group's scale
    qx, sx = quantize_activations(x)
    assert qx.shape == (3, 3, GROUP_SIZE) and sx.shape == (3, 3)
    assert sx[0, 0] == 0 and not qx[0, 0].any()
    assert torch.equal(qx[:, :, 6:][:, 2], torch.zeros(3, GROUP_SIZE - 6, dtype=torch.int8))
    assert int(qx[1, 0].abs().max()) == 127 and qx[1, 0, 5] == 127
    padded = torch.nn.functional.pad(x, (0, 3 * GROUP_SIZE - 70)).view(3, 3, GROUP_SIZE)
    error = (qx.float() * sx[..., None] - padded).abs()
    assert torch.all(error <= sx[..., None] / 2 * (1 + 1e-6))


@pytest.mark.parametrize("rows", [1, 2, 3, MANY_ROWS_FROM, 5, 7, 13, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_gives_the_bits_of_its_torch_reference(shape, rows):
    out_features, in_features, bias = shape
    linear = _linear(out_features, in_features, bias)
    layer = W8A8Linear(linear)
    x = _x(rows, in_features)
    q, scale = quantize(linear.weight)
    assert all(torch.equal(a, b) for a, b in zip(layer.quantized(), (q, scale)))
    assert torch.equal(layer(x), reference(x, q, scale, layer.bias))


@pytest.mark.parametrize("rows", [1, MANY_ROWS_FROM + 1])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_infinite_input_makes_its_row_nan_as_in_float32(bad, rows):
    """Not a finite value out of garbage: the group's scale becomes NaN, so every output of the
    row is NaN (float32 gives NaN or +-inf there), in the kernel and its reference alike; the
    other rows keep their bits."""
    linear = _linear(37, 70, True)
    layer = W8A8Linear(linear)
    x = _x(rows, 70)
    x[0, 40] = bad
    got = layer(x)
    assert torch.isnan(got[0]).all()
    assert torch.isnan(reference(x, *layer.quantized(), layer.bias)[0]).all()
    assert not torch.isfinite(linear(x).detach()[0]).all()
    assert torch.equal(got[1:], layer(x[1:]))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_layer_stays_close_to_the_float_layer(shape):
    """Tolerance: each weight and each input is within half a step of its group's scale (1/254
    of its largest value), so on random data the relative error of an output vector is about
    1% (measured 0.6-0.7%); 3% bounds it."""
    out_features, in_features, bias = shape
    linear = _linear(out_features, in_features, bias)
    x = torch.randn(16, in_features, generator=torch.Generator().manual_seed(3))
    want = linear(x).detach()
    got = W8A8Linear(linear)(x)
    assert (got - want).norm() / want.norm() < 0.03


@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_count_gives_the_same_bits_without_padding(shape):
    out_features, in_features, bias = shape
    layer = W8A8Linear(_linear(out_features, in_features, bias))
    assert invariant_min_rows(layer, in_features, torch.float32, CPU) == 1
    x = _x(3 * MANY_ROWS_FROM + 1, in_features, seed=2)
    together = layer(x)                                # the prefill tiles
    for r in range(x.shape[0]):
        assert torch.equal(layer(x[r:r + 1]), together[r:r + 1])   # the GEMV tiles


def test_without_the_library_the_reference_runs(monkeypatch):
    layer = W8A8Linear(_linear(37, 70, True))
    x = _x(5, 70)
    with_kernel = layer(x)
    monkeypatch.setattr(w8a8_linear, "library", lambda: None)
    assert torch.equal(layer(x), with_kernel)


@needs_c_kernels
def test_w8a8_model_loads_quantized_with_its_own_fingerprint(llama_path, caplog, monkeypatch):
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    with caplog.at_level(logging.INFO, logger="rtpkv"):
        model = load(llama_path, weight_type="W8A8_INT8")
    layers = [m for m in model.module.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 4 * model.spec.num_layers + 1 and model.module.linear_path == "w8a8"
    assert model.module.lm_head in layers and model.config.weight_quantization == "w8a8_int8"
    assert "WEIGHT_TYPE=W8A8_INT8: 9 linear layers" in caplog.text
    assert "activations quantized per row and group" in caplog.text
    assert model.module.fused is not None
    fingerprints = {model.fingerprint, load(llama_path).fingerprint,
                    load(llama_path, weight_type="INT8").fingerprint}
    assert len(fingerprints) == 3


def test_w8a8_wins_over_the_weight_only_alias(llama_path, make_pipeline, monkeypatch):
    prompt = "hello what's your name"
    by_name = run(make_pipeline(weight_type="W8A8_INT8"), prompt, max_new_tokens=8,
                  return_logits=True)
    weight_only = run(make_pipeline(weight_type="INT8"), prompt, max_new_tokens=8,
                      return_logits=True)
    monkeypatch.setenv("INT8_MODE", "1")
    monkeypatch.setenv("WEIGHT_TYPE", "w8a8_int8")
    assert load(llama_path).config.weight_quantization == "w8a8_int8"
    by_env = run(make_pipeline(), prompt, max_new_tokens=8, return_logits=True)
    assert torch.equal(by_env.logits, by_name.logits)
    assert not torch.equal(weight_only.logits, by_name.logits)
