"""FLEX_ATTENTION's decode path on the CPU: decode-only steps as a batch of one-token queries over a
decode-shaped BlockMask (flex_attention_decode), run eagerly against the float32 reference, with
the block structure the compiled decoding kernel walks (full pages, partial last / window-first
pages) checked page by page against the dense mask, and the masks reused across steps."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from kvllm.attention.backends import flex_attention_impl as flex
from kvllm.attention.backends.flex_attention import FlexAttentionBackend
from kvllm.attention.backends.flex_attention_decode import FlexDecodeMasks, decode_bucket
from kvllm.attention.reference import make_paged_batch
from kvllm.attention.testing import prepare_backend_case, run_backend_case

CONTEXTS = [0, 15, 31, 80, 130]


@pytest.fixture(autouse=True)
def eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(flex.COMPILE_ENV, "0")


@pytest.mark.parametrize(
    ("block_size", "heads", "window", "soft_cap"),
    [(16, (4, 4), None, None), (32, (8, 2), 24, None), (16, (8, 1), None, 2.0), (16, (4, 2), 5, None),
     (64, (4, 2), 40, 3.0)],
)  # fmt: skip
def test_decode_path_matches_reference(block_size, heads, window, soft_cap) -> None:
    case = run_backend_case(
        FlexAttentionBackend, [1] * len(CONTEXTS), CONTEXTS, *heads, 32, block_size, torch.float32, "cpu",
        seed=3, sliding_window=window, logits_soft_cap=soft_cap, impl_attrs={"decode_path_eager": True},
    )  # fmt: skip
    assert case.metadata.decode_masks is not None, "a decode-only step must take the decode path"
    assert case.rel_max_error() < 1e-5


def test_mixed_steps_do_not_take_the_decode_path() -> None:
    batch = make_paged_batch([1, 1, 7], [5, 40, 3], 4, 2, 32, 16, seed=0)
    case = prepare_backend_case(FlexAttentionBackend, batch, impl_attrs={"decode_path_eager": True})
    assert case.metadata.decode_masks is None


@pytest.mark.parametrize("window", [None, 1, 16, 23, 200])
@pytest.mark.parametrize("block_size", [16, 32])
def test_block_structure_is_exact(window: int | None, block_size: int) -> None:
    """Listed pages (full and partial) are exactly the pages with a visible slot; full pages are
    visible in every slot; the two lists never share a page; padding rows list nothing."""
    contexts = [0, 15, 31, 63, 64, 130, 7]
    batch = make_paged_batch([1] * len(contexts), contexts, 2, 2, 16, block_size, seed=1)
    num_blocks, num_reqs = batch.num_blocks, len(contexts)
    masks = FlexDecodeMasks(block_size, batch.block_table.shape[1], torch.device("cpu"))
    seq_lens = batch.metadata.seq_lens.to(torch.int32)
    bm = masks.block_mask(batch.block_table, seq_lens, num_reqs, num_blocks, window)
    rows = decode_bucket(num_reqs)
    dense = create_mask(bm.mask_mod, rows, 1, 1, num_blocks * block_size, device="cpu")[:, 0, 0]
    visible_pages = dense.view(rows, num_blocks, block_size)
    for b in range(rows):
        partial = set(bm.kv_indices[b, 0, 0, : bm.kv_num_blocks[b, 0, 0]].tolist())
        full = set(bm.full_kv_indices[b, 0, 0, : bm.full_kv_num_blocks[b, 0, 0]].tolist())
        seen = {p for p in range(num_blocks) if visible_pages[b, p].any()}
        assert not partial & full and partial | full == seen, (b, partial, full, seen)
        assert all(visible_pages[b, p].all() for p in full)
        assert len(partial) == int(bm.kv_num_blocks[b, 0, 0])  # no page listed twice
        if b >= num_reqs:
            assert not seen
        else:
            expected = min(batch.seq_lens[b], window or batch.seq_lens[b])
            assert int(dense[b].sum()) == expected


def test_masks_are_reused_across_steps_and_follow_the_new_batch() -> None:
    builder_case = run_backend_case(
        FlexAttentionBackend, [1, 1, 1], [9, 40, 77], 4, 2, 32, 16, torch.float32, "cpu", seed=0,
        impl_attrs={"decode_path_eager": True}, builder_limits=(8, 64, 256),
    )  # fmt: skip
    masks = builder_case.metadata.decode_masks
    first = masks.block_mask(builder_case.metadata.block_table, builder_case.metadata.seq_lens, 3, 11, None)
    assert (
        masks.block_mask(builder_case.metadata.block_table, builder_case.metadata.seq_lens, 4, 11, None)
        is first
    )
    second = make_paged_batch([1] * 4, [3, 100, 17, 60], 4, 2, 32, 16, seed=5)
    meta = builder_case.builder.build(second.metadata)
    assert meta.decode_masks is masks  # the builder's one set of decode masks
    seq = second.metadata.seq_lens.to(torch.int32)
    bm = masks.block_mask(meta.block_table, seq, 4, second.num_blocks, None)
    counts = (bm.kv_num_blocks[:4, 0, 0] + bm.full_kv_num_blocks[:4, 0, 0]).tolist()
    assert counts == [-(-s // 16) for s in second.seq_lens]
