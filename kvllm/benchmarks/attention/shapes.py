"""Batch shapes of the attention benchmark: groups of requests with one query and context length each."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """`count` requests with `query_len` new tokens over `context_len` cached ones, or, with `context_hi`,
    over a context drawn uniformly from [context_len, context_hi] for each request (seeded, in draw order:
    a serving batch's requests are not sorted by length)."""

    count: int
    query_len: int
    context_len: int
    context_hi: int | None = None

    def contexts(self) -> list[int]:
        if self.context_hi is None:
            return [self.context_len] * self.count
        draw = random.Random(f"{self.count}x{self.query_len}@{self.context_len}~{self.context_hi}")
        return [draw.randint(self.context_len, self.context_hi) for _ in range(self.count)]


@dataclass(frozen=True)
class Shape:
    name: str
    groups: tuple[Group, ...]  # decode groups (query_len 1) must come first

    def requests(self) -> tuple[list[int], list[int]]:
        qs, cs = [], []
        for g in self.groups:
            qs += [g.query_len] * g.count
            cs += g.contexts()
        return qs, cs

    def flops(self, num_heads: int, head_size: int) -> float:
        pairs = sum(q * c + q**2 / 2 for q, c in zip(*self.requests()))
        return 4.0 * num_heads * head_size * pairs

    def kv_bytes(self, num_kv_heads: int, head_size: int, itemsize: int) -> float:
        tokens = sum(q + c for q, c in zip(*self.requests()))
        return 2.0 * tokens * num_kv_heads * head_size * itemsize


STANDARD_SHAPES = (
    Shape("decode b256 x ctx1k", (Group(256, 1, 1023),)),
    Shape("decode b1 x ctx32k", (Group(1, 1, 32767),)),
    Shape("decode b8 x ctx8k", (Group(8, 1, 8191),)),
    Shape("prefill 8x2048 causal", (Group(8, 2048, 0),)),
    Shape("mixed 16x512/1k + 240 dec", (Group(240, 1, 1023), Group(16, 512, 1024))),
)
TINY_SHAPES = (
    Shape("tiny decode b4 x ctx64", (Group(4, 1, 63),)),
    Shape("tiny prefill 2x48 causal", (Group(2, 48, 0),)),
    Shape("tiny mixed 2x16/32 + 3 dec", (Group(3, 1, 40), Group(2, 16, 32))),
)


def parse_shape(text: str) -> Shape:
    """`NAME:COUNTxQLEN@CTX[+COUNTxQLEN@CTX...]`, e.g. `long:4x1@65535` or `mix:30x1@2000+2x256@512`;
    `CTX` may be a range `LO~HI` (each request's context drawn from it), e.g. `ragged:256x1@100~2047`."""
    name, _, spec = text.rpartition(":")
    groups = []
    for part in spec.split("+"):
        count, _, rest = part.partition("x")
        qlen, _, ctx = rest.partition("@")
        lo, _, hi = (ctx or "0").partition("~")
        if hi and int(hi) < int(lo):
            raise ValueError(f"shape {text!r}: context range {ctx} runs backwards")
        groups.append(Group(int(count), int(qlen), int(lo), int(hi) if hi else None))
    groups.sort(key=lambda g: g.query_len != 1)
    return Shape(name or spec, tuple(groups))
