"""The piecewise CUDA-graph runner's bookkeeping on the CPU (kvllm/worker/piecewise_graph.py): the
padded bucket, attention on the real tokens only through the shared buffers, and refusals.
The capture itself needs a GPU (tests/gpu/test_cuda_graphs_gpu.py); engine equality with HF over
the equality suite runs in tests/unit/test_cuda_graph_runner.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvllm.forward_context import get_forward_context, set_forward_context
from kvllm.worker.piecewise_graph import PiecewiseGraphRunner, default_token_buckets

HEADS, HEAD_SIZE, HIDDEN = 2, 4, 8


class CausalMeanImpl:
    """Attention stand-in whose output row t depends on the rows 0..t it is given: a running mean."""

    def __init__(self) -> None:
        self.seen_tokens: list[int] = []

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, kv_written=False):
        self.seen_tokens.append(query.shape[0])
        steps = torch.arange(1, query.shape[0] + 1, dtype=query.dtype).view(-1, 1, 1)
        result = (query + key * value).cumsum(0) / steps
        if output is None:
            return result
        output.copy_(result)
        return output


class Layer(nn.Module):
    kv_written = False  # True: the layer stored its K/V before attention, as the fused RoPE kernel does

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.proj = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen) / 3)
        self.impl = CausalMeanImpl()
        self.kv_cache = torch.empty(0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = (h @ self.proj).view(-1, HEADS, HEAD_SIZE)
        context = get_forward_context()
        if context.attention_hook is not None:
            out = context.attention_hook(self, self.query(x, context), x.sin(), x.cos(), self.kv_written)
        else:
            out = self.impl.forward(
                self, x, x.sin(), x.cos(), None, None, torch.empty_like(x), kv_written=self.kv_written
            )
        return h + out.reshape(-1, HIDDEN)

    def query(self, x: torch.Tensor, context) -> torch.Tensor:
        """The query handed to the runner's hook."""
        return x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(50, HIDDEN, generator=gen))
        self.layers = nn.ModuleList([Layer(1), Layer(2)])

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed[ids] + positions.unsqueeze(1)
        for layer in self.layers:
            h = layer(h)
        return h


class Builder:
    def build(self, common):
        return common


def _runner(
    model: Model, ids: torch.Tensor, positions: torch.Tensor, buckets: list[int]
) -> PiecewiseGraphRunner:
    slots = torch.arange(ids.shape[0])
    return PiecewiseGraphRunner(model, Builder(), ids, positions, slots, buckets, lambda n: f"capture {n}")


def _captured_two_layers(
    layers: list[nn.Module], seed: int
) -> tuple[Model, torch.Tensor, torch.Tensor, PiecewiseGraphRunner]:
    """A model of these two layers, 16 random ids and positions, and its runner with the 16-token bucket
    captured."""
    model = Model()
    model.layers = nn.ModuleList(layers)
    ids = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(16, dtype=torch.float32)
    runner = _runner(model, ids, positions, [16])
    runner.capture()
    return model, ids, positions, runner


def test_a_padded_step_equals_the_eager_forward_of_its_real_tokens() -> None:
    model = Model()
    ids = torch.randint(0, 50, (32,), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(32, dtype=torch.float32)
    runner = _runner(model, ids, positions, [8, 16, 32])
    runner.capture()
    assert sorted(runner.captured) == [8, 16, 32]
    for n, bucket in ((5, 8), (8, 8), (9, 16), (17, 32)):
        for layer in model.layers:
            layer.impl.seen_tokens.clear()
        with torch.no_grad():
            ids.random_(0, 50)  # the padding rows n..bucket-1 hold other tokens each time
            got = runner.replay("step", n).clone()
            for layer in model.layers:
                assert layer.impl.seen_tokens[-1] == n  # attention ran on the real tokens only
            with set_forward_context(None):
                want = model(ids[:n], positions[:n])
        assert runner.bucket_for(n) == bucket
        torch.testing.assert_close(got, want)
        assert (runner.slot_mapping[n:bucket] == -1).all()  # padding rows store no K/V
    assert runner.num_replays == 4


def test_bucket_cap_switch(monkeypatch) -> None:
    monkeypatch.setenv("KVLLM_PIECEWISE_MAX_TOKENS", "2048")
    assert default_token_buckets(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    monkeypatch.setenv("KVLLM_PIECEWISE_MAX_TOKENS", "2k")
    with pytest.raises(ValueError, match="KVLLM_PIECEWISE_MAX_TOKENS='2k'"):
        default_token_buckets(8192)


def test_buckets_and_refusals() -> None:
    assert default_token_buckets(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192]
    assert default_token_buckets(16384) == default_token_buckets(8192)
    assert default_token_buckets(5000) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096]
    assert default_token_buckets(100) == [16, 32, 64]
    assert default_token_buckets(8) == []
    model = Model()
    ids, positions = torch.zeros(16, dtype=torch.long), torch.zeros(16)
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        _runner(model, ids, positions, [32])
    with pytest.raises(ValueError, match="distinct positive"):
        _runner(model, ids, positions, [8, 8])
    runner = _runner(model, ids, positions, [8])
    runner.capture()
    assert not runner.can_replay(9) and not runner.can_replay(0) and runner.can_replay(8)
    with pytest.raises(ValueError, match="no piecewise graphs for 9 tokens"):
        runner.replay("step", 9)


class CacheReaderImpl:
    """Attention stand-in for a layer that stored its K/V itself (kv_written): it records the key/value it
    is handed and, like TRITON_ATTN's unified kernel, computes from the query alone."""

    def __init__(self, reads_kv: bool) -> None:
        self.reads_kv = reads_kv
        self.seen_kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reads_written_kv(self) -> bool:
        return self.reads_kv

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, kv_written=False):
        assert kv_written
        self.seen_kv.append((key.clone(), value.clone()))
        steps = torch.arange(1, query.shape[0] + 1, dtype=query.dtype).view(-1, 1, 1)
        output.copy_(query.cumsum(0) / steps)
        return output


class KVWrittenLayer(Layer):
    kv_written = True

    def __init__(self, seed: int, reads_kv: bool) -> None:
        super().__init__(seed)
        self.impl = CacheReaderImpl(reads_kv)


@pytest.mark.parametrize("reads_kv", [True, False])
def test_stored_kv_is_copied_only_for_a_backend_that_reads_it(reads_kv) -> None:
    """A layer that stored its K/V (kv_written) gets them copied into the shared buffers only when its
    backend reads them then; either way the step equals the eager forward."""
    model, ids, positions, runner = _captured_two_layers(
        [KVWrittenLayer(1, reads_kv), KVWrittenLayer(2, reads_kv)], 6
    )
    like = torch.empty(16, HEADS, HEAD_SIZE)
    for role in ("key", "value"):
        runner.shared.get(role, like).fill_(float("nan"))
    for layer in model.layers:
        layer.impl.seen_kv.clear()
    with torch.no_grad():
        got = runner.replay("step", 11).clone()
        handed = [kv for layer in model.layers for kv in layer.impl.seen_kv]
        with set_forward_context(None):
            want = model(ids[:11], positions[:11])
    torch.testing.assert_close(got, want)
    assert len(handed) == 2
    for key, value in handed:
        assert key.shape == value.shape == (11, HEADS, HEAD_SIZE)
        assert bool(key.isnan().all()) != reads_kv and bool(value.isnan().all()) != reads_kv


class QueryWritingLayer(KVWrittenLayer):
    """Writes its query into the runner's shared buffer itself, as the fused RoPE kernel does (query_target)."""

    num_heads, head_size = HEADS, HEAD_SIZE

    def query(self, x: torch.Tensor, context) -> torch.Tensor:
        target = context.query_buffer(self, x.shape[0], x.dtype)
        target.copy_(x.reshape(x.shape[0], -1))
        return target.view(-1, HEADS, HEAD_SIZE)


def test_a_query_written_into_the_shared_buffer_is_not_copied(monkeypatch) -> None:
    from kvllm.worker import piecewise_graph

    same = []

    def spy(a, b):
        same.append(piecewise_graph_same_view(a, b))
        return same[-1]

    piecewise_graph_same_view = piecewise_graph._same_view
    monkeypatch.setattr(piecewise_graph, "_same_view", spy)
    model, ids, positions, runner = _captured_two_layers(
        [QueryWritingLayer(1, False), QueryWritingLayer(2, False)], 7
    )
    same.clear()
    with torch.no_grad():
        got = runner.replay("step", 13).clone()
        with set_forward_context(None):
            want = model(ids[:13], positions[:13])
    torch.testing.assert_close(got, want)
    assert same == [True, True]  # both layers' queries were already in place: no copy
