"""kernels/huge_pages.py: weights moved into one huge-page mapping keep their values, dtypes
and shapes, and each starts on a cache line; tensors it cannot move are left alone."""

import mmap
from types import SimpleNamespace

import pytest
import torch

from conftest import load, needs_c_kernels
from rtpkv.kernels.fused_decoder import kernel_weights
from rtpkv.kernels.huge_pages import ALIGN, HUGE_PAGE, huge_page_buffer, into_huge_pages

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="madvise(MADV_HUGEPAGE) is Linux's")


def test_moved_tensors_keep_their_values():
    g = torch.Generator().manual_seed(0)
    holders = [SimpleNamespace(packed=torch.randn(3, 17, 16, generator=g)),
               SimpleNamespace(q=torch.randint(-127, 128, (5, 33), dtype=torch.int8, generator=g),
                               scale=torch.rand(5, 2, generator=g)),
               SimpleNamespace(packed=torch.randn(7, generator=g).to(torch.bfloat16))]
    names = [(holders[0], "packed"), (holders[1], "q"), (holders[1], "scale"),
             (holders[2], "packed")]
    before = [getattr(obj, name).clone() for obj, name in names]
    assert into_huge_pages(names)
    after = [getattr(obj, name) for obj, name in names]
    for old, new in zip(before, after):
        assert new.dtype == old.dtype and new.shape == old.shape and torch.equal(new, old)
        assert new.data_ptr() % ALIGN == 0
    # one mapping, in the order given
    assert [t.data_ptr() for t in after] == sorted(t.data_ptr() for t in after)
    assert after[-1].data_ptr() - after[0].data_ptr() < 1 << 20


def test_a_tensor_it_cannot_move_leaves_all_in_place():
    holders = [SimpleNamespace(packed=torch.randn(4, 4)),
               SimpleNamespace(packed=torch.randn(4, 4).t())]   # not contiguous
    before = [h.packed for h in holders]
    assert not into_huge_pages([(h, "packed") for h in holders])
    assert all(h.packed is b for h, b in zip(holders, before))
    assert not into_huge_pages([])


def test_a_huge_page_buffer_starts_on_a_huge_page_zeroed():
    buffer = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE + 5
    assert buffer.data_ptr() % HUGE_PAGE == 0 and not buffer.any()
    buffer[-1] = 7   # writable to its last byte
    assert buffer[-1] == 7


@needs_c_kernels
def test_a_loaded_models_kernel_weights_sit_in_one_huge_page_mapping(llama_path):
    """CausalLM.prepare moves every C-kernel weight (attention, MLP, LM head): they start on a
    huge page and span no more than their sizes rounded to cache lines, back to back."""
    modules = load(llama_path).module.modules()
    held = [getattr(layer, name) for layer, name in kernel_weights(modules)]
    assert len(held) >= 5
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in held]
    start = min(t.data_ptr() for t in held)
    end = max(t.data_ptr() + size for t, size in zip(held, sizes))
    assert start % HUGE_PAGE == 0 and end - start == sum(sizes)
