"""The sharding math of tensor parallel, in one process: each rank's layer is built as rank r of N
(`simulated_tensor_parallel`, no process group) and loaded from the whole checkpoint tensors; the
ranks' outputs, concatenated (column parallel) or summed (row parallel, what the all-reduce does),
equal the TP=1 layer's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from kvllm.distributed.parallel_state import get_tensor_model_parallel_world_size, simulated_tensor_parallel
from kvllm.layers.linear import Linear, MergedLinear, QKVLinear
from kvllm.layers.quantization.awq import AWQConfig
from kvllm.layers.quantization.base import QuantizationConfig
from kvllm.layers.quantization.compressed_tensors import CompressedTensorsConfig
from kvllm.layers.quantization.fp8 import Fp8Config
from kvllm.layers.quantization.gptq import GPTQConfig
from kvllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

Make = Callable[[], nn.Module]


def _random_checkpoint(layer: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors in the checkpoint's format (the TP=1 layer's parameters before post-processing)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in layer.named_parameters(recurse=False):
        fill = getattr(param, "dummy_init", None)
        if fill is not None:
            fill(param.data, generator)
        else:
            param.data.copy_(torch.randn(param.shape, generator=generator))
        out[name] = param.data.clone()
    return out


def _shards(layer: Linear, name: str, tensor: torch.Tensor) -> list[tuple[int | None, torch.Tensor]]:
    """A fused layer's checkpoint tensor as its per-shard tensors (as a checkpoint stores them)."""
    param = getattr(layer, name)
    dim = getattr(param, "output_dim", None)
    if len(layer.output_sizes) == 1:
        return [(None, tensor)]
    if getattr(param, "per_shard", False):  # one entry per shard
        return list(enumerate(tensor.unbind(0)))
    if dim is None:  # shared by the shards: every shard's checkpoint has it
        return [(i, tensor) for i in range(len(layer.output_sizes))]
    divisor = getattr(param, "output_divisor", 1)
    pieces = tensor.split([size // divisor for size in layer.output_sizes], dim=dim)
    return list(enumerate(pieces))


def _build(make: Make, checkpoint: dict[str, torch.Tensor], rank: int, size: int) -> nn.Module:
    reference = make()  # the TP=1 layer, unprocessed: how the checkpoint's tensors split into shards
    with simulated_tensor_parallel(rank, size):
        layer = make()
    for name, tensor in checkpoint.items():
        param = getattr(layer, name)
        for shard_id, piece in _shards(reference, name, tensor):
            param.weight_loader(param, piece, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _full(make: Make, seed: int = 0) -> tuple[Linear, dict[str, torch.Tensor]]:
    layer = make()
    checkpoint = _random_checkpoint(layer, seed)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, checkpoint


QUANT: dict[str, Callable[[], QuantizationConfig | None]] = {
    "none": lambda: None,
    # Static activation scales: with dynamic ones each rank scales its slice of the input by that
    # slice's largest value, which rounds differently from the whole row (as in vLLM).
    "fp8-tensor": lambda: Fp8Config(static_activations=True),
    "fp8-block": lambda: Fp8Config(weight_block_size=(128, 128)),
    "awq": lambda: AWQConfig(group_size=64),
    "gptq": lambda: GPTQConfig(group_size=64, desc_act=False, sym=False, zero_plus_one=True),
}


@pytest.mark.parametrize("quant", list(QUANT))
@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_partial_sums_add_up_to_the_whole_layer(quant: str, tp: int) -> None:
    if quant == "fp8-block" and tp == 4:
        pytest.skip("128-wide fp8 blocks: 512 inputs split in 4 leaves 128 per rank (tp=2 covers 256)")
    in_size = 512 if quant == "fp8-block" else 256

    def make() -> Linear:
        return Linear(
            in_size, 128, bias=True, quant_config=QUANT[quant](), prefix="down_proj", parallel="row"
        )

    full, checkpoint = _full(make)
    x = torch.randn(5, in_size)
    expected = full(x)
    total = torch.zeros_like(expected)
    for rank in range(tp):
        layer = _build(make, checkpoint, rank, tp)
        part = in_size // tp
        assert layer.in_features == part
        total += layer.quant_method.apply(layer, x[:, rank * part : (rank + 1) * part], None)
    torch.testing.assert_close(total + full.bias, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quant", list(QUANT))
def test_merged_column_parallel_ranks_hold_their_slice_of_every_shard(quant: str) -> None:
    tp, sizes = 2, [256, 256]

    def make() -> MergedLinear:
        return MergedLinear(
            256, sizes, bias=quant == "none", quant_config=QUANT[quant](), prefix="gate_up_proj",
            shard_prefixes=["gate_proj", "up_proj"],
        )  # fmt: skip

    full, checkpoint = _full(make, seed=1)
    x = torch.randn(3, 256)
    gate, up = full(x).split(sizes, dim=-1)
    outs = [_build(make, checkpoint, rank, tp)(x).split([128, 128], dim=-1) for rank in range(tp)]
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), gate, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], -1), up, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(8, 4, 2), (8, 2, 4), (8, 1, 2), (4, 2, 4)])
def test_qkv_heads_split_and_kv_heads_replicate_below_one_per_rank(
    heads: int, kv_heads: int, tp: int
) -> None:
    head = 16

    def make() -> QKVLinear:
        return QKVLinear(64, head, heads, kv_heads, bias=True, prefix="qkv_proj")

    full, checkpoint = _full(make, seed=2)
    x = torch.randn(4, 64)
    q, k, v = full.split(full(x))
    q, k, v = (t.view(4, -1, head) for t in (q, k, v))
    group = heads // kv_heads  # query heads per KV head
    for rank in range(tp):
        layer = _build(make, checkpoint, rank, tp)
        assert (layer.num_heads, layer.num_kv_heads) == (heads // tp, max(kv_heads // tp, 1))
        rq, rk, rv = (t.view(4, -1, head) for t in layer.split(layer(x)))
        mine = list(range(rank * heads // tp, (rank + 1) * heads // tp))
        torch.testing.assert_close(rq, q[:, mine])
        # The KV heads this rank's query heads read, in order.
        kv_mine = sorted({h // group for h in mine})
        assert len(kv_mine) == layer.num_kv_heads
        torch.testing.assert_close(rk, k[:, kv_mine])
        torch.testing.assert_close(rv, v[:, kv_mine])


@pytest.mark.parametrize(("vocab", "tp"), [(13, 2), (16, 4), (10, 3)])
def test_vocab_parallel_embedding_and_lm_head_pad_the_vocab_and_recombine(vocab: int, tp: int) -> None:
    weight = torch.randn(vocab, 8)
    ids = torch.randint(0, vocab, (20,))
    hidden = torch.randn(5, 8)
    embedded = torch.zeros(20, 8)
    logits = []
    for rank in range(tp):
        with simulated_tensor_parallel(rank, tp):
            embedding = VocabParallelEmbedding(vocab, 8)
            head = ParallelLMHead(vocab, 8)
        for module in (embedding, head):
            module.weight.weight_loader(module.weight, weight)
        assert embedding.weight.shape[0] == -(-vocab // tp)
        # What the embedding's forward computes before its all-reduce.
        mine = (ids >= embedding.vocab_start_index) & (ids < embedding.vocab_end_index)
        local = torch.where(mine, ids - embedding.vocab_start_index, 0)
        embedded += torch.nn.functional.embedding(local, embedding.weight) * mine[:, None]
        logits.append(hidden @ head.weight.t())
    torch.testing.assert_close(embedded, weight[ids])
    gathered = torch.cat(logits, dim=-1)
    assert gathered.shape[1] == -(-vocab // tp) * tp
    torch.testing.assert_close(gathered[:, :vocab], hidden @ weight.t())
    assert torch.all(gathered[:, vocab:] == 0)  # padding rows are zero; gather_logits cuts them off


def test_what_does_not_split_is_refused_with_the_reason() -> None:
    with simulated_tensor_parallel(0, 2):
        with pytest.raises(ValueError, match=r"do not split over tensor_parallel_size=2"):
            Linear(64, 33, parallel="column", prefix="odd")
        with pytest.raises(ValueError, match=r"6 attention heads and 3 KV heads do not split"):
            QKVLinear(64, 16, 6, 3, prefix="qkv")
        ct = CompressedTensorsConfig.from_config(
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "symmetric": True,
                            "strategy": "group",
                            "group_size": 64,
                            "dynamic": False,
                        },  # fmt: skip
                    }
                },
            }
        )
        with pytest.raises(ValueError, match=r"does not say how its .* splits along the input"):
            Linear(256, 64, quant_config=ct, parallel="row", prefix="down_proj")
        fused = MergedLinear(64, [32, 32], prefix="gate_up_proj")
        with pytest.raises(ValueError, match=r"stores the shards .* as one tensor"):
            fused.weight_loader(fused.weight, torch.randn(64, 64))
    assert get_tensor_model_parallel_world_size() == 1  # the simulation ends with its block


def test_tp1_layers_are_the_plain_layers() -> None:
    """At TP=1 nothing is split and no collective is wired in (the row layer's forward is Linear's)."""
    layer = Linear(64, 32, bias=True, parallel="row")
    assert layer.parallel is None and layer.in_features == 64
    embedding = VocabParallelEmbedding(10, 4)
    assert embedding.weight.shape == (10, 4)


@pytest.mark.parametrize("has_bias", [False, True])
def test_moe_experts_split_along_the_intermediate_size(has_bias: bool) -> None:
    from kvllm.layers.moe import FusedMoE
    from kvllm.layers.moe.fused_moe import fused_experts

    experts, hidden, inter, tp = 4, 16, 32, 2
    generator = torch.Generator().manual_seed(3)
    ckpt = {
        (e, shard): torch.randn(shape, generator=generator) * 0.3
        for e in range(experts)
        for shard, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter)))
    }
    biases = {
        (e, shard): torch.randn(size, generator=generator)
        for e in range(experts)
        for shard, size in (("w1", inter), ("w3", inter), ("w2", hidden))
    }

    def build(rank: int, size: int) -> FusedMoE:
        with simulated_tensor_parallel(rank, size):
            moe = FusedMoE(experts, 2, hidden, inter, has_bias=has_bias, prefix="experts")
        for (e, shard), tensor in ckpt.items():
            param = moe.w2_weight if shard == "w2" else moe.w13_weight
            moe.weight_loader(param, tensor, shard, e)
            if has_bias:
                bias = moe.w2_bias if shard == "w2" else moe.w13_bias
                moe.weight_loader(bias, biases[(e, shard)], shard, e)
        return moe

    x = torch.randn(6, hidden, generator=generator)
    logits = torch.randn(6, experts, generator=generator)
    expected = build(0, 1)(x, logits)
    # What the all-reduce sums: each rank's partial output (its forward before the reduce).
    ranks = [build(rank, tp) for rank in range(tp)]
    assert all(moe.intermediate_size == inter // tp for moe in ranks)
    total = sum(
        fused_experts(
            x, moe.w13_weight, moe.w2_weight, *_routing(moe, logits), "silu", moe.w13_bias, moe.w2_bias
        )
        for moe in ranks
    )
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def _routing(moe: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from kvllm.layers.moe.router import softmax_topk

    return softmax_topk(logits, moe.top_k, moe.renormalize)
