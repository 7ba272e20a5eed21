"""The Mamba2 mixer (kernels/mamba2.py, model_factory/mamba2.py) against transformers' Granite
4.0-H mixer (its torch path, float32), and its exactness: chunked == one pass and alone ==
batched bit for bit, states saved inside a chunk equal to the states a chunk ending there
leaves; in C and in the torch reference."""

from __future__ import annotations

import pytest
import torch
from transformers import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer)

from rtpkv.kernels import mamba2
from rtpkv.model_factory.granite import mamba2_spec
from rtpkv.model_factory.mamba2 import Mamba2Mixer
from rtpkv.model_factory.recurrent import RecurrentBatch

from conftest import c_kernels_missing

CHUNK = 8   # transformers' chunk size here: lengths below, at and above it
HIDDEN = 32
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
             mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=CHUNK, mamba_conv_bias=True,
             mamba_proj_bias=False)


@pytest.fixture(params=["c", "torch"])
def path(request, monkeypatch) -> str:
    if request.param == "c":
        missing = c_kernels_missing()
        if missing:
            pytest.skip(missing)
    else:
        monkeypatch.setattr(mamba2, "_library", lambda: None)
    return request.param


def _layers(time_step_limit: tuple[float, float]
            ) -> tuple[GraniteMoeHybridMambaLayer, Mamba2Mixer]:
    """transformers' mixer with random weights (A_log, D, dt_bias and the norm too), and ours
    holding the same."""
    torch.manual_seed(0)
    config = GraniteMoeHybridConfig(hidden_size=HIDDEN, num_attention_heads=4, rms_norm_eps=1e-6,
                                    num_hidden_layers=1, layer_types=["linear_attention"],
                                    time_step_limit=time_step_limit, **MAMBA)
    theirs = GraniteMoeHybridMambaLayer(config, 0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        theirs.A_log.copy_(torch.rand(4) * 2 - 1)
        theirs.dt_bias.copy_(torch.rand(4) * 2 - 1.5)
    ours = Mamba2Mixer(HIDDEN, mamba2_spec(config.to_dict()), 1e-6)
    ours.load_state_dict(theirs.state_dict())
    ours.convert(lambda linear: linear)
    return theirs, ours


@pytest.fixture(scope="module")
def layers() -> tuple[GraniteMoeHybridMambaLayer, Mamba2Mixer]:
    return _layers((0.0, float("inf")))


def _pools(mixer: Mamba2Mixer, slots: int = 4) -> list[torch.Tensor]:
    return [torch.zeros(slots, *spec.shape) for spec in mixer.state_specs()]


def _one(slot: int, n: int) -> RecurrentBatch:
    return RecurrentBatch(query_start=[0], query_len=[n], slots=[slot])


@pytest.mark.parametrize("length", [1, 5, 2 * CHUNK + 3])
def test_matches_transformers(layers, path, length):
    theirs, ours = layers
    torch.manual_seed(length)
    x = torch.randn(1, length, HIDDEN)
    with torch.no_grad():
        expected = theirs(x)[0]
        got = ours(x[0], _one(1, length), _pools(ours))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    if length > 1:   # the rest of the prompt from the state of its first part: the state is right
        states = _pools(ours)
        with torch.no_grad():
            first = ours(x[0, :3], _one(2, 3), states)
            rest = ours(x[0, 3:], _one(2, length - 3), states)
        torch.testing.assert_close(torch.cat([first, rest]), expected, rtol=1e-4, atol=1e-5)


def test_time_step_limit_matches_transformers(path):
    """A finite time_step_limit clamps softplus(dt + dt_bias) (transformers' chunked path)."""
    theirs, ours = _layers((0.2, 0.5))
    x = torch.randn(1, CHUNK + 2, HIDDEN)
    with torch.no_grad():
        expected = theirs(x)[0]
        got = ours(x[0], _one(0, CHUNK + 2), _pools(ours))
        unclamped = _layers((0.0, float("inf")))[0](x)[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(unclamped, expected, rtol=1e-3, atol=1e-3)


def test_chunked_and_batched_are_exact(layers, path):
    """A prompt in chunks of 1, 3 and 7 gives the bits of one pass (outputs and final states);
    batched with another sequence, its bits alone; states saved inside a chunk are the states
    a chunk ending there leaves. (On the in projection's rows: the linear layers' own
    invariance is theirs, kernels/linear.py.)"""
    _, ours = layers
    weights = ours.weights
    torch.manual_seed(1)
    n = 2 * CHUNK + 5
    proj, other = torch.randn(n, weights.projection_size), torch.randn(6, weights.projection_size)
    conv, ssm = _pools(ours, 8)
    saves = [(11, 6), (4, 5), (n, 7)]   # in any order
    whole = mamba2.mix(weights, proj, [0], [n], [0], conv, ssm, [saves])
    for size in (1, 3, 7):
        conv_c, ssm_c = _pools(ours, 8)
        parts, ends = [], {}
        for start in range(0, n, size):
            end = min(n, start + size)
            parts.append(mamba2.mix(weights, proj[start:end], [0], [end - start], [0], conv_c,
                                    ssm_c))
            ends[end] = (conv_c[0].clone(), ssm_c[0].clone())
        assert torch.equal(torch.cat(parts), whole)
        assert torch.equal(conv_c[0], conv[0]) and torch.equal(ssm_c[0], ssm[0])
        for k, slot in saves:
            if k in ends:
                assert torch.equal(conv[slot], ends[k][0]) and torch.equal(ssm[slot], ends[k][1])
    assert torch.equal(conv[7], conv[0]) and torch.equal(ssm[7], ssm[0])
    conv_b, ssm_b = _pools(ours)
    batched = mamba2.mix(weights, torch.cat([other, proj]), [0, 6], [6, n], [3, 1], conv_b, ssm_b)
    assert torch.equal(batched[6:], whole)
    assert torch.equal(conv_b[1], conv[0]) and torch.equal(ssm_b[1], ssm[0])


def test_c_agrees_with_torch_reference(layers, monkeypatch):
    missing = c_kernels_missing()
    if missing:
        pytest.skip(missing)
    _, ours = layers
    torch.manual_seed(2)
    proj = torch.randn(9, ours.weights.projection_size)
    initial = [torch.randn(5, *spec.shape) for spec in ours.state_specs()]
    results = []
    for fallback in (False, True):
        if fallback:
            monkeypatch.setattr(mamba2, "_library", lambda: None)
        conv, ssm = (t.clone() for t in initial)
        out = mamba2.mix(ours.weights, proj, [0, 4], [4, 5], [2, 0], conv, ssm,
                         [[(2, 1)], [(1, 3), (5, 4)]])
        results.append((out, conv, ssm))
    for c, t in zip(*results):
        torch.testing.assert_close(c, t, rtol=1e-5, atol=1e-6)


def test_bad_input_is_refused(layers):
    _, ours = layers
    conv, ssm = _pools(ours)
    proj = torch.zeros(4, ours.weights.projection_size)
    with pytest.raises(ValueError, match="not disjoint"):
        mamba2.mix(ours.weights, proj, [0, 2], [3, 2], [0, 1], conv, ssm)
    with pytest.raises(IndexError, match="slots 7..7"):
        mamba2.mix(ours.weights, proj, [0], [4], [7], conv, ssm)
    with pytest.raises(ValueError, match="repeat"):
        mamba2.mix(ours.weights, proj, [0], [4], [1], conv, ssm, [[(2, 1)]])
    with pytest.raises(ValueError, match=r"save offsets \[5\]"):
        mamba2.mix(ours.weights, proj, [0], [4], [0], conv, ssm, [[(5, 2)]])
    with pytest.raises(ValueError, match="ssm_state"):
        mamba2.mix(ours.weights, proj, [0], [4], [0], conv, ssm[:, :, :, :4].contiguous())
