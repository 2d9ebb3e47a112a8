"""Paged KV-cache block accounting with prefix caching.

Invariants (checked by tests/unit/test_kv_cache_manager.py):
- a block is either held (ref_cnt > 0, not in the free queue) or free (ref_cnt == 0, in the
  free queue); every block is exactly one of the two;
- a free block may still hold a cached prefix (its hash is in `cached_blocks`); it is reused
  on a hit, or evicted, least recently freed first, when a new block is needed;
- only full blocks are hashed; the hash chains the parent block's hash with the block's token
  ids, so equal hashes mean equal whole prefixes. A hit does not trust the hash: the block's token
  ids, its salt and its parent (the block it was computed after, in that block's current
  `generation`, which changes whenever the block's content is dropped) must equal the request's,
  so a hash collision, accidental or crafted, is a miss and never K/V computed after another prefix;
- a request's `cache_salt` (vLLM's) takes the place of the first block's parent, and each cached
  block keeps the salt it was computed under: requests share cached blocks only when their salts
  are equal (both None included), so one tenant cannot probe another's prompts by cache timing;
- a request never gets a hit on the block holding its last prompt token, so at least one
  token is always computed and yields logits to sample from.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvllm.core.request import Request


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens a cached block holds, for the hit check
    cache_salt: str | None = None  # the salt of the request that computed it, for the hit check
    # The block it was computed after, as (block id, that block's generation), for the hit check.
    parent: tuple[int, int] | None = None
    generation: int = 0  # bumped whenever the block's content is dropped (evicted, reused, reset)


class KVCacheManager:
    """Hands out KV blocks to requests; answers `can_allocate` before `allocate` commits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks}: the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.num_hashed_blocks: dict[str, int] = {}
        # Counters of prompt tokens looked up / found in the prefix cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    # ---- prefix cache ------------------------------------------------------------------------

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chain of full-block hashes to cover its current tokens."""
        tokens = request.all_token_ids
        num_full = len(tokens) // self.block_size
        hashes = request.block_hashes
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else ("cache_salt", request.cache_salt)
            hashes.append(hash((parent, tuple(tokens[i * self.block_size : (i + 1) * self.block_size]))))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request (nothing is committed)."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(request)
        # Never the block with the last token: one token must be computed to get logits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        parent: tuple[int, int] | None = None
        tokens = request.all_token_ids
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            expected = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.blocks[block_id]
            if (
                block.token_ids != expected
                or block.cache_salt != request.cache_salt
                or block.parent != parent
            ):
                break  # a hash collision
            hits.append(block_id)
            parent = (block_id, block.generation)
        return hits

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---- allocation --------------------------------------------------------------------------

    def can_allocate(self, request: Request, num_new_tokens: int, cached_prefix: list[int] = ()) -> bool:
        held = len(self.req_blocks.get(request.request_id, ())) or len(cached_prefix)
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - held
        # Cached-prefix blocks that sit in the free queue stop being free once touched.
        num_reused_free = sum(1 for b in cached_prefix if self.blocks[b].ref_cnt == 0)
        return needed <= self.num_free_blocks - num_reused_free

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: list[int] = ()) -> None:
        """Give the request blocks for `num_new_tokens` more tokens. Call can_allocate first."""
        if not self.can_allocate(request, num_new_tokens, cached_prefix):
            raise RuntimeError(f"allocate() without room for request {request.request_id}")
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if cached_prefix:
            assert not blocks, "a cached prefix is only attached to a request holding no blocks"
            for block_id in cached_prefix:
                self._touch(block_id)
            blocks.extend(cached_prefix)
            self.num_hashed_blocks[request.request_id] = len(cached_prefix)
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(blocks)
        for _ in range(needed):
            blocks.append(self._take_free_block())
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks; cached ones stay reusable until evicted."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_hashed_blocks.pop(request.request_id, None)
        # Tail blocks first, so they are evicted before the shared prefix blocks.
        for block_id in reversed(blocks):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed more often than taken"
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's reset_prefix_cache); refused (False) while a request
        holds blocks, since their hashes are what later requests would match."""
        if self.req_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
            block.cache_salt = None
            block.parent = None
            block.generation += 1
        self.cached_blocks.clear()
        return True

    # ---- internals ---------------------------------------------------------------------------

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict the cached prefix it held
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
            block.token_ids = None
            block.cache_salt = None
            block.parent = None
        # New content from here on: blocks computed after the old content no longer follow this block.
        block.generation += 1
        block.ref_cnt = 1
        return block_id

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that become full once `num_tokens` tokens are in the cache."""
        num_full = num_tokens // self.block_size
        start = self.num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(request)
        # A block whose last token is still being sampled has no hash yet: registered once it has.
        num_full = min(num_full, len(request.block_hashes))
        blocks = self.req_blocks[request.request_id]
        tokens = request.all_token_ids
        for i in range(start, num_full):
            block = self.blocks[blocks[i]]
            block_hash = request.block_hashes[i]
            if block.block_hash is None:
                block.block_hash = block_hash
                block.token_ids = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
                block.cache_salt = request.cache_salt
                if i > 0:
                    previous = self.blocks[blocks[i - 1]]
                    block.parent = (previous.block_id, previous.generation)
                self.cached_blocks.setdefault(block_hash, block.block_id)
        self.num_hashed_blocks[request.request_id] = num_full
