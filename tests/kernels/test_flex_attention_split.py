"""FLEX_ATTENTION's split path on the CPU: decodes as a batch of one-token queries over a decode-shaped
BlockMask (flex_attention_decode) and fresh prefills over the step's own K/V with large tiles
(flex_attention_prefill), run eagerly against the float32 reference; the block structures the
compiled kernels walk (full and partial blocks) checked block by block against the dense masks;
the decode masks reused across steps."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from kvllm.attention.backends import flex_attention_impl as flex
from kvllm.attention.backends.flex_attention import FlexAttentionBackend
from kvllm.attention.backends.flex_attention_decode import FlexDecodeMasks, decode_bucket
from kvllm.attention.backends.flex_attention_prefill import TILE, fresh_prefill
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


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "window"),
    [([1, 1, 37, 5, 300], [31, 130, 0, 0, 0], None), ([1, 1, 37, 5, 300], [31, 130, 0, 0, 0], 130),
     ([200, 7, 129], [0, 0, 0], 24), ([1], [0], None)],
)  # fmt: skip
def test_decodes_and_fresh_prefills_match_reference(query_lens, context_lens, window) -> None:
    case = run_backend_case(
        FlexAttentionBackend, query_lens, context_lens, 8, 2, 32, 16, torch.float32, "cpu", seed=4,
        sliding_window=window, pad_tokens=3, impl_attrs={"decode_path_eager": True},
    )  # fmt: skip
    meta = case.metadata
    num_decodes = sum(q == 1 for q in query_lens)  # decodes come first
    assert meta.num_decodes == num_decodes
    assert meta.fresh_prefill_from == (num_decodes if num_decodes < len(query_lens) else None)
    assert case.rel_max_error() < 1e-5


@pytest.mark.parametrize(
    ("query_lens", "window"), [([128, 128], None), ([200, 56], 24), ([100, 7, 29], None)]
)
def test_a_step_of_fresh_prefills_returns_the_kernels_output(query_lens, window, monkeypatch) -> None:
    """No decodes: the output is the kernel's own (no zeroed copy); rows that fill the packed length
    (256 = 2 tiles) go in as the step's views, others as a padded copy; graph-padding rows come out zero."""
    copies = []
    real_pad = flex._pad_rows
    monkeypatch.setattr(flex, "_pad_rows", lambda x, n: copies.append(n) or real_pad(x, n))
    case = run_backend_case(
        FlexAttentionBackend, query_lens, [0] * len(query_lens), 8, 2, 32, 16, torch.float32, "cpu", seed=5,
        sliding_window=window, pad_tokens=3, impl_attrs={"decode_path_eager": True},
    )  # fmt: skip
    assert case.metadata.num_decodes == 0 and case.metadata.fresh_prefill_from == 0
    assert case.rel_max_error() < 1e-5
    assert case.out.shape == case.query.shape and torch.equal(
        case.out[sum(query_lens) :], case.out.new_zeros(3, 8, 32)
    )
    # The reference run and the backend's: q, k, v padded (three copies each) only when 256 rows do not fill it.
    assert copies == ([] if sum(query_lens) == 256 else [256] * len(copies)) and len(copies) % 3 == 0


def test_prefills_with_cached_context_take_the_general_path() -> None:
    batch = make_paged_batch([1, 1, 7], [5, 40, 3], 4, 2, 32, 16, seed=0)
    case = prepare_backend_case(FlexAttentionBackend, batch, impl_attrs={"decode_path_eager": True})
    assert case.metadata.decode_masks is None and case.metadata.fresh_prefill_from is None


def test_cuda_takes_the_split_path_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA steps shaped for it take the split path unless KVLLM_FLEX_SPLIT_PATH=0 (read when the layer is
    built); the CPU never does (only tests that set decode_path_eager run it there)."""
    batch = make_paged_batch([1, 1, 9], [5, 40, 0], 4, 2, 32, 16, seed=0)
    cuda = torch.device("cuda")
    monkeypatch.delenv(flex.SPLIT_PATH_ENV, raising=False)
    case = prepare_backend_case(FlexAttentionBackend, batch)
    assert case.metadata.decode_masks is not None  # a split-shaped step
    assert case.impl._use_split_path(case.metadata, cuda)
    assert not case.impl._use_split_path(case.metadata, torch.device("cpu"))
    for off in ("0", "off"):
        monkeypatch.setenv(flex.SPLIT_PATH_ENV, off)
        turned_off = prepare_backend_case(FlexAttentionBackend, batch)
        assert not turned_off.impl._use_split_path(turned_off.metadata, cuda)


@pytest.mark.parametrize("window", [None, 1, 100, 128, 300])
@pytest.mark.parametrize("query_lens", [[300, 7, 129, 1, 256], [128, 128], [5]])
def test_fresh_prefill_block_structure_is_exact(window: int | None, query_lens: list[int]) -> None:
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    fresh = fresh_prefill(qsl, 0, window, torch.device("cpu"))
    bm, length = fresh.block_mask, fresh.block_mask.seq_lengths[0]
    dense = create_mask(bm.mask_mod, 1, 1, length, length, device="cpu")[0, 0]
    tiles = dense.view(length // TILE, TILE, length // TILE, TILE).any(3).any(1)
    whole = dense.view(length // TILE, TILE, length // TILE, TILE).all(3).all(1)
    for i in range(length // TILE):
        partial = bm.kv_indices[0, 0, i, : bm.kv_num_blocks[0, 0, i]].tolist()
        full = bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]].tolist()
        assert len(set(partial)) == len(partial) and not set(partial) & set(full)
        assert set(partial) | set(full) == set(tiles[i].nonzero().flatten().tolist()), i
        assert all(whole[i, j] for j in full), i
    assert int(dense.sum()) == sum(
        sum(min(p + 1, window or p + 1) for p in range(n)) for n in query_lens
    )  # each token sees itself and its predecessors (in the window)


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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _decoding_kernel_walk(bm, b: int, split_kv: int, block_n: int, full: bool) -> list[int]:
    """The pages torch's compiled decoding kernel visits for batch row `b`, partial or full blocks,
    addressed as torch/_inductor/kernel/flex/templates/flex_decode.py.jinja (torch 2.11-2.13) does:
    both index tensors offset with KV_IDX's strides, each split's first index wrapped at KV_IDX's
    width, KV splits of the whole KV length (the BlockMask has full blocks), full blocks assigned
    from the last split."""
    sparse = bm.BLOCK_SIZE[1]
    kv_len = bm.seq_lengths[1]
    multiple = sparse // block_n
    stride_z = bm.kv_indices.stride(0)  # KV_IDX's, for FULL_KV_IDX too
    max_kv_idx = bm.kv_indices.shape[-1]
    source = bm.full_kv_indices if full else bm.kv_indices
    num = bm.full_kv_num_blocks if full else bm.kv_num_blocks
    flat = source.flatten()  # contiguous int32 buffers (the builder's)
    base = b * stride_z
    total = int(num.flatten()[b * num.stride(0)])
    tile_multiple = _cdiv(_cdiv(kv_len, split_kv), block_n)
    pages = []
    for t in range(split_kv):
        start = ((split_kv - t - 1) if full else t) * tile_multiple
        last_valid = min(total * multiple, max(_cdiv(kv_len, block_n), 1))
        end = min(start + tile_multiple, last_valid)
        off_n = int(flat[base + (start // multiple) % max_kv_idx]) * sparse + (start % multiple) * block_n
        for n in range(start, end):
            pages.append(off_n // sparse)
            cur_idx = n // multiple
            cur = int(flat[base + cur_idx])
            nxt = int(flat[base + cur_idx + 1]) if cur_idx + 1 < total else 0
            if (n + 1) % multiple == 0:
                off_n += (nxt - cur) * sparse - (multiple - 1) * block_n
            else:
                off_n += block_n
    return pages


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize(("block_size", "split_kv"), [(16, 1), (16, 4), (16, 64), (32, 8), (128, 3)])
def test_compiled_decoding_kernel_reads_each_requests_own_pages(
    window: int | None, block_size: int, split_kv: int
) -> None:
    """The decode BlockMask as torch's decoding kernel reads it (not as eager flex does): every row's
    full and partial pages are its own. A partial index tensor narrower than the full one made rows
    past the first read another row's full pages on the H200."""
    contexts = [0, 15, 31, 63, 64, 130, 7, 300, 47]
    batch = make_paged_batch([1] * len(contexts), contexts, 2, 2, 16, block_size, seed=2)
    masks = FlexDecodeMasks(block_size, batch.block_table.shape[1], torch.device("cpu"))
    seq_lens = batch.metadata.seq_lens.to(torch.int32)
    bm = masks.block_mask(batch.block_table, seq_lens, len(contexts), batch.num_blocks, window)
    assert bm.kv_indices.shape == bm.full_kv_indices.shape  # the kernel's assumption, stated
    block_n = math.gcd(block_size, 64)  # the BLOCK_N flex_attention_impl passes the kernel
    for b in range(decode_bucket(len(contexts))):
        partial = _decoding_kernel_walk(bm, b, split_kv, block_n, full=False)
        full = _decoding_kernel_walk(bm, b, split_kv, block_n, full=True)
        expected_full = bm.full_kv_indices[b, 0, 0, : bm.full_kv_num_blocks[b, 0, 0]].tolist()
        expected_partial = bm.kv_indices[b, 0, 0, : bm.kv_num_blocks[b, 0, 0]].tolist()
        multiple = block_size // block_n
        assert sorted(set(full)) == sorted(expected_full) and len(full) == multiple * len(expected_full), b
        assert sorted(set(partial)) == sorted(expected_partial), b
        if b < len(contexts):
            pages = -(-int(seq_lens[b]) // block_size)
            first = max(0, int(seq_lens[b]) - window) // block_size if window else 0
            own = set(batch.block_table[b, first:pages].tolist())
            assert set(full) | set(partial) == own, (b, full, partial, own)


@pytest.mark.parametrize("window", [None, 20])
def test_decode_graph_metadata_follows_each_replays_batch(window: int | None) -> None:
    """A decode graph keeps prepare_for_capture's metadata for every replay: prepare_for_replay refills
    the builder's fixed buffers with the new batch, and the layer that first built the decode mask
    rebuilds it on each forward, so the same metadata attends over each batch as its own build() does."""
    # One cache size for all three (a new size would get a fresh mask whoever the owner is).
    contexts = [[90, 60, 3, 17], [3, 90, 17, 60], [60, 17, 90, 3]]
    cases = [
        run_backend_case(
            FlexAttentionBackend, [1] * 4, ctx, 4, 2, 32, 16, torch.float32, "cpu", seed=seed,
            sliding_window=window, impl_attrs={"decode_path_eager": True}, builder_limits=(8, 64, 256),
        )
        for seed, ctx in enumerate(contexts)
    ]  # fmt: skip
    for case in cases:
        assert case.rel_error() < 1e-5  # the eager build(): the yardstick
        assert case.batch.num_blocks == cases[0].batch.num_blocks
    first = cases[0]
    graph_meta = first.builder.prepare_for_capture(first.batch.metadata)
    assert graph_meta.for_graph and graph_meta.decode_masks is not None
    for i, case in enumerate(cases):
        if i:
            assert first.builder.prepare_for_replay(case.batch.metadata) is graph_meta
        for _ in range(2):  # the owner layer, then the same forward again (a second replay of one batch)
            out = first.impl.forward(case.layer, case.query, case.key, case.value, case.kv_cache, graph_meta)
            err = ((out.float() - case.ref).norm() / case.ref.norm()).item()
            assert err < 1e-5, (i, err)


def test_decode_graphs_need_the_decode_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine captures FLEX decode graphs only where decode steps take the decode path; a graph's
    metadata refuses the general path (its masks would be the capture's, stale on every replay)."""
    batch = make_paged_batch([1, 1], [5, 40], 4, 2, 32, 16, seed=0)
    case = prepare_backend_case(FlexAttentionBackend, batch)  # decode_path_eager off: the general path
    graph_meta = case.builder.prepare_for_capture(batch.metadata)
    with pytest.raises(RuntimeError, match="general path .* cannot replay"):
        case.impl.forward(case.layer, case.query, case.key, case.value, case.kv_cache, graph_meta)
    prefill = make_paged_batch([1, 3], [5, 40], 4, 2, 32, 16, seed=0)
    with pytest.raises(ValueError, match="one query token per request"):
        case.builder.prepare_for_capture(prefill.metadata)

    monkeypatch.delenv(flex.SPLIT_PATH_ENV, raising=False)
    monkeypatch.setenv(flex.COMPILE_ENV, "1")
    assert FlexAttentionBackend.cudagraphs_off_reason("cuda") is None
    assert "CUDA only" in FlexAttentionBackend.cudagraphs_off_reason("cpu")
    monkeypatch.setenv(flex.SPLIT_PATH_ENV, "0")
    assert flex.SPLIT_PATH_ENV in FlexAttentionBackend.cudagraphs_off_reason("cuda")
    monkeypatch.delenv(flex.SPLIT_PATH_ENV)
    monkeypatch.setenv(flex.COMPILE_ENV, "0")
    assert flex.COMPILE_ENV in FlexAttentionBackend.cudagraphs_off_reason("cuda")
    monkeypatch.setattr(flex.FlexAttentionImpl, "decode_path_eager", True)
    assert FlexAttentionBackend.cudagraphs_off_reason("cpu") is None
