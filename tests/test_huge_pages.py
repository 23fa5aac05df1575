"""Packed weights on 2 MiB pages: the buffer's pieces, and a loaded model's
matrices read from it (the same ones the layers computed with before)."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from inflight import LLM
from inflight.model.layers import Linear
from inflight.ops.huge_pages import (HUGE_PAGE, HugePageBuffer, buffer_bytes, huge_page_bytes,
                                     huge_pages_available)

needs_huge_pages = pytest.mark.skipif(not huge_pages_available(),
                                      reason="no transparent huge pages on this machine")


def test_pieces_are_copies_on_cache_lines_that_outlive_the_buffer():
    tensors = [torch.randn(7, 5), torch.arange(100, dtype=torch.uint8), torch.randn(3, 64)]
    buffer = HugePageBuffer(buffer_bytes(tensors))
    assert buffer.data_ptr % HUGE_PAGE == 0
    copies = [buffer.copy_in(t) for t in tensors]
    for tensor, copy in zip(tensors, copies):
        assert copy.data_ptr() % 64 == 0 and copy.dtype == tensor.dtype
        assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()
    assert copies[1].data_ptr() - copies[0].data_ptr() == 192  # 140 bytes, rounded up
    del buffer
    gc.collect()
    assert torch.equal(copies[2], tensors[2])


def test_a_full_buffer_refuses_more():
    buffer = HugePageBuffer(128)
    buffer.copy_in(torch.zeros(16))
    with pytest.raises(ValueError, match="do not fit"):
        buffer.copy_in(torch.zeros(17))


@needs_huge_pages
def test_a_filled_buffer_lies_on_huge_pages():
    tensor = torch.randn(4 * HUGE_PAGE // 4)
    buffer = HugePageBuffer(buffer_bytes([tensor]))
    # Counted per mapping, and the kernel may merge this one with a neighbour
    # advised alike (another buffer still alive, say a loaded model's): what
    # the copy adds, not the total.
    untouched = huge_page_bytes(buffer.data_ptr)
    buffer.copy_in(tensor)
    assert huge_page_bytes(buffer.data_ptr) >= untouched + HUGE_PAGE
    # The control: memory advised against huge pages, written through, counts
    # none. (Not the heap: how much of it lies on huge pages is the kernel's
    # and the allocator's business; once, in CI, 111 MB of it did.)
    control = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    control.madvise(mmap.MADV_NOHUGEPAGE)
    small = torch.frombuffer(control, dtype=torch.uint8)
    small.fill_(1)
    assert huge_page_bytes(small.data_ptr()) == 0


@pytest.mark.parametrize("quantization", [None, "q8_0"])
def test_a_loaded_model_reads_its_matrices_from_one_buffer(tiny_model, quantization):
    """Every packed matrix moved into one mapping, in order; a tied embedding
    still reads the output layer's quantized matrix."""
    llm = LLM(str(tiny_model("llama-gqa")), dtype="float32", quantization=quantization,
              kv_cache_memory="8MiB")
    model = llm.engine.runner.model
    arrays = [m.packed if quantization is None else m.packed.data
              for m in model.modules() if isinstance(m, Linear)]
    bounds = sorted((a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()) for a in arrays)
    if huge_pages_available():
        assert bounds[-1][1] - bounds[0][0] <= buffer_bytes(arrays)  # back to back
        assert bounds[0][0] % HUGE_PAGE == 0
    if quantization is not None:
        assert model.embed_tokens.packed is model.lm_head.packed


@needs_huge_pages
def test_the_default_models_matrices_stream_from_huge_pages(default_llm):
    model = default_llm.engine.runner.model
    for module in (model.lm_head, model.layers[0].self_attn.qkv_proj,
                   model.layers[-1].mlp.down_proj):
        assert huge_page_bytes(module.packed.data_ptr()) >= 100 * HUGE_PAGE  # of ~257


@pytest.mark.parametrize("setting, moved", [("always madvise [never]", False),
                                            ("always [madvise] never", True)])
def test_the_machines_setting_decides_whether_weights_move(tiny_model, tmp_path, monkeypatch,
                                                           setting, moved):
    from inflight.model.weight_pages import move_packed_weights_to_huge_pages
    from inflight.ops import huge_pages

    if moved and not huge_pages_available():
        pytest.skip("no transparent huge pages on this machine")
    llm = LLM(str(tiny_model("llama-gqa")), dtype="float32", kv_cache_memory="8MiB")
    model = llm.engine.runner.model
    before = model.lm_head.packed.clone()
    (tmp_path / "enabled").write_text(setting + "\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "enabled")
    old = model.lm_head.packed.data_ptr()
    move_packed_weights_to_huge_pages(model)
    assert (model.lm_head.packed.data_ptr() != old) == moved
    assert torch.equal(model.lm_head.packed, before)
