"""The weights the C kernels stream live in one buffer (kernels/huge_pages.py), in the order a
forward reads them, each on its own page, for every kind of linear layer that streams; the
originals are let go as they are copied; outputs do not change (the parity and invariance tests
run on models loaded this way)."""

import gc
import weakref

import pytest
import torch
from conftest import load

from rtpkv.kernels.huge_pages import ALIGN, gather_weights


def _streamed(module):
    order = [m for layer in module.model.layers
             for m in (layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up,
                       layer.mlp.down_proj)] + [module.lm_head]
    return [getattr(m, name) for m in order for name in m.streamed]


@pytest.mark.parametrize("options", [{"rtpkv_linear": "avx2"}, {"weight_type": "INT8"},
                                     {"weight_type": "W8A8_INT8"}])
def test_streamed_weights_lie_in_one_buffer_in_reading_order(llama_path, options):
    module = load(llama_path, **options).module
    buffer = module.weight_buffer
    tensors = _streamed(module)
    assert len(tensors) >= 9 and buffer is not None
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    last = start
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % ALIGN == 0
        assert last <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end
        last = t.data_ptr() + t.numel() * t.element_size()


def test_a_model_on_onednn_keeps_its_weights_where_onednn_put_them(llama_path):
    module = load(llama_path, rtpkv_linear="onednn").module
    assert module.weight_buffer is None and _streamed(module) == []


def test_gathering_copies_the_values_and_lets_the_originals_go():
    class Holder:
        pass

    holders = [Holder() for _ in range(3)]
    originals = [torch.randn(5, 7), torch.arange(12, dtype=torch.int8), torch.randn(3)]
    for h, t in zip(holders, originals):
        h.w = t
    expected = [t.clone() for t in originals]
    gone = [weakref.ref(t) for t in originals]
    del originals, t
    gather_weights([(h, "w") for h in holders])
    gc.collect()
    assert all(ref() is None for ref in gone)
    for h, want in zip(holders, expected):
        assert h.w.dtype == want.dtype and torch.equal(h.w, want)
