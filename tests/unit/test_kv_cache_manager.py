"""KVCacheManager: allocation accounting, prefix-cache hits, LRU eviction and the invariants."""

import random

import pytest

from kvllm.core.kv_cache_manager import KVCacheManager
from kvllm.core.request import Request
from kvllm.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        rid, list(tokens), SamplingParams(), max_tokens=16, eos_token_ids=(0,), cache_salt=cache_salt
    )


def check_invariants(kv: KVCacheManager) -> None:
    held = {b for blocks in kv.req_blocks.values() for b in blocks}
    for block in kv.blocks:
        in_free = block.block_id in kv.free_queue
        assert in_free == (block.ref_cnt == 0), block
        assert (block.block_id in held) == (block.ref_cnt > 0), block
    for block_hash, block_id in kv.cached_blocks.items():
        assert kv.blocks[block_id].block_hash == block_hash


def schedule_whole(kv: KVCacheManager, request: Request) -> int:
    """Attach the cached prefix and allocate the rest of the prompt; returns cached tokens."""
    cached = kv.find_cached_prefix(request)
    request.num_computed_tokens = len(cached) * kv.block_size
    n = request.num_tokens - request.num_computed_tokens
    assert kv.can_allocate(request, n, cached)
    kv.allocate(request, n, cached)
    request.num_computed_tokens += n
    return len(cached) * kv.block_size


def test_allocate_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    r = make_request("a", list(range(1, 10)))  # 9 tokens -> 3 blocks
    schedule_whole(kv, r)
    assert len(kv.get_block_ids("a")) == 3 and kv.num_free_blocks == 7
    check_invariants(kv)
    kv.free(r)
    assert kv.num_free_blocks == 10
    check_invariants(kv)


def test_can_allocate_refuses_when_full():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    r = make_request("a", list(range(1, 10)))
    assert not kv.can_allocate(r, 9)
    with pytest.raises(RuntimeError):
        kv.allocate(r, 9)
    check_invariants(kv)


def test_prefix_hit_shares_blocks_and_keeps_last_token_uncached():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    prefix = list(range(100, 112))  # 3 full blocks
    a = make_request("a", prefix + [1, 2])
    assert schedule_whole(kv, a) == 0
    b = make_request("b", prefix + [3, 4, 5])
    assert schedule_whole(kv, b) == 12
    assert kv.get_block_ids("a")[:3] == kv.get_block_ids("b")[:3]
    assert all(kv.blocks[i].ref_cnt == 2 for i in kv.get_block_ids("a")[:3])
    # A prompt that is exactly the cached prefix still computes its last block.
    c = make_request("c", prefix)
    assert schedule_whole(kv, c) == 8
    check_invariants(kv)


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(1, 13)) + [99])  # 3 full blocks + 1
    schedule_whole(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 6 and len(kv.cached_blocks) == 3
    b = make_request("b", list(range(1, 13)) + [77])
    assert schedule_whole(kv, b) == 12
    kv.free(b)
    # A request that needs every block evicts all cached prefixes.
    c = make_request("c", list(range(500, 523)))
    schedule_whole(kv, c)
    assert kv.num_free_blocks == 0
    assert all(
        kv.blocks[i].block_hash is None or kv.blocks[i].block_id in kv.get_block_ids("c") for i in range(6)
    )
    check_invariants(kv)
    kv.free(c)
    check_invariants(kv)


def test_hash_collision_is_a_miss(monkeypatch):
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5])
    schedule_whole(kv, a)
    b = make_request("b", [9, 9, 9, 9, 5])
    kv.update_block_hashes(b)
    b.block_hashes[0] = a.block_hashes[0]  # force the same hash for different tokens
    assert kv.find_cached_prefix(b) == []


def test_cache_salt_shares_blocks_only_under_the_same_salt():
    kv = KVCacheManager(num_blocks=30, block_size=4)
    prefix = list(range(100, 112))  # 3 full blocks
    assert schedule_whole(kv, make_request("a", prefix + [1], cache_salt="tenant-a")) == 0
    assert schedule_whole(kv, make_request("b", prefix + [2], cache_salt="tenant-b")) == 0
    assert schedule_whole(kv, make_request("unsalted", prefix + [3])) == 0
    assert schedule_whole(kv, make_request("a2", prefix + [4], cache_salt="tenant-a")) == 12
    assert schedule_whole(kv, make_request("b2", prefix + [5], cache_salt="tenant-b")) == 12
    assert schedule_whole(kv, make_request("unsalted2", prefix + [6])) == 12
    assert kv.get_block_ids("a2")[:3] == kv.get_block_ids("a")[:3] != kv.get_block_ids("b")[:3]
    check_invariants(kv)


def test_cache_salt_mismatch_under_an_equal_hash_is_a_miss():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5], cache_salt="x")
    schedule_whole(kv, a)
    b = make_request("b", [1, 2, 3, 4, 5], cache_salt="y")
    kv.update_block_hashes(b)
    b.block_hashes[0] = a.block_hashes[0]  # same tokens, same hash, another tenant
    assert kv.find_cached_prefix(b) == []


def test_a_colliding_block_computed_after_another_prefix_is_a_miss():
    """A hash collision on a later block (crafted here: same tokens, same salt) whose K/V followed another
    prefix must not be served: the block's parent is checked, not only its hash and tokens."""
    kv = KVCacheManager(num_blocks=20, block_size=4)
    t1 = [50, 51, 52, 53]
    a = make_request("a", [1, 2, 3, 4] + t1 + [9])
    b = make_request("b", [5, 6, 7, 8] + t1 + [9])
    schedule_whole(kv, a)
    assert schedule_whole(kv, b) == 0
    honest = make_request("honest", [5, 6, 7, 8] + t1 + [7])
    assert len(kv.find_cached_prefix(honest)) == 2  # b's two blocks
    crafted = make_request("crafted", [5, 6, 7, 8] + t1 + [7])
    kv.update_block_hashes(crafted)
    crafted.block_hashes[1] = a.block_hashes[
        1
    ]  # block 1 now "collides" with a's, computed after [1, 2, 3, 4]
    assert kv.find_cached_prefix(crafted) == kv.get_block_ids("b")[:1]


def test_a_block_whose_parent_was_reused_is_a_miss():
    """Once a block's parent is evicted and refilled, the child's K/V no longer follows what the parent
    holds: its old chain must not be found again, even through a hash collision."""
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    schedule_whole(kv, a)
    parent, child = kv.get_block_ids("a")[:2]
    kv.free(a)
    kv.free_queue.move_to_end(parent, last=False)  # the parent is evicted first (the child stays cached)
    c = make_request("c", [30, 31, 32])
    schedule_whole(kv, c)
    assert kv.get_block_ids("c") == [parent]
    kv.free(c)
    again = make_request("again", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.update_block_hashes(again)
    kv.cached_blocks[again.block_hashes[0]] = parent  # crafted: the refilled parent found for block 0
    kv.blocks[parent].token_ids, kv.blocks[parent].block_hash = (1, 2, 3, 4), again.block_hashes[0]
    assert kv.find_cached_prefix(again) == [parent]  # not [parent, child]: child followed the old content
    assert kv.blocks[child].parent is not None


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=40, block_size=4)
    live: list[Request] = []
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(3)]
    for step in range(300):
        if live and rng.random() < 0.4:
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
            r = make_request(f"r{step}", tokens)
            cached = kv.find_cached_prefix(r)
            r.num_computed_tokens = len(cached) * 4
            n = r.num_tokens - r.num_computed_tokens
            if kv.can_allocate(r, n, cached):
                kv.allocate(r, n, cached)
                live.append(r)
        check_invariants(kv)
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == 40
    assert kv.prefix_cache_queries == 0  # lookups are recorded by the scheduler, not here
