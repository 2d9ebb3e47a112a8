"""The MoE layer (kvllm/layers/moe): the Triton grouped-GEMM path (on the CPU interpreter here) and the
plain-torch path against a float32 per-token reference, the routers, and the layer's weight loading.

The reference loops over tokens and their k experts one at a time in float32, so it shares no code
with either path. Tolerances: float32 differs by summation order only; 16-bit results round GEMM 1,
the activation and GEMM 2 to the dtype (three roundings of values ~ 1), so about 3 ulp.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvllm.layers.moe import FusedMoE, fused_experts, fused_experts_torch, softmax_topk, topk_softmax
from kvllm.layers.moe.fused_moe_torch import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from kvllm.layers.moe.fused_moe_triton import FusedMoEConfig, fused_experts_triton, moe_align_block_size
from kvllm.layers.ops.dispatch import fused_ops_mode

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}


def randn(*shape: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * scale


def reference_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return gate * torch.sigmoid(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    gate = torch.clamp(gate, max=SWIGLU_OAI_LIMIT)
    up = torch.clamp(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (up + 1) * gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate)


def reference(hidden, w13, w2, topk_weights, topk_ids, activation="silu", w13_bias=None, w2_bias=None):
    """float32, one (token, expert) pair at a time."""
    hidden, w13, w2 = hidden.double(), w13.double(), w2.double()
    out = torch.zeros_like(hidden)
    inter = w13.shape[1] // 2
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e] @ hidden[t]
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e].double()
            y = w2[e] @ reference_activation(gate_up[:inter], gate_up[inter:], activation)
            if w2_bias is not None:
                y = y + w2_bias[e].double()
            out[t] += float(topk_weights[t, j]) * y
    return out.float()


def make_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, seed, bias=False, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = randn(num_tokens, hidden, generator=g)
    w13 = randn(num_experts, 2 * inter, hidden, generator=g, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, generator=g, scale=inter**-0.5)
    logits = randn(num_tokens, num_experts, generator=g)
    if skew:  # most tokens pick the first experts; the last ones get none
        logits[:, : num_experts // 2] += 4.0
    topk_weights, topk_ids = softmax_topk(logits, top_k, renormalize=True)
    biases = (
        (randn(num_experts, 2 * inter, generator=g), randn(num_experts, hidden, generator=g))
        if bias
        else (None, None)
    )
    cast = [t.to(dtype) if t is not None else None for t in (x, w13, w2, *biases)]
    return cast[0], cast[1], cast[2], topk_weights, topk_ids, cast[3], cast[4]


@pytest.mark.parametrize(
    "num_pairs,num_experts,block_m",
    # the last two: several programs counting into the same experts (atomics), empty experts, and more
    # tiles than one pass of the tile loop
    [(1, 4, 16), (37, 5, 16), (64, 8, 32), (200, 3, 64), (700, 60, 16), (1500, 256, 64)],
)
def test_align_block_size_covers_every_pair_once(num_pairs, num_experts, block_m):
    g = torch.Generator().manual_seed(num_pairs)
    ids = torch.randint(0, num_experts, (num_pairs, 1), generator=g, dtype=torch.int32)
    sorted_ids, block_experts, num_padded = moe_align_block_size(ids, block_m, num_experts)
    used = int(num_padded)
    assert used % block_m == 0 and used <= sorted_ids.numel()
    assert (sorted_ids[used:] == num_pairs).all()
    real = sorted_ids[:used][sorted_ids[:used] < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    for pos in range(used):
        pair = int(sorted_ids[pos])
        if pair < num_pairs:
            assert int(ids.view(-1)[pair]) == int(block_experts[pos // block_m])
    counts = torch.bincount(ids.view(-1).long(), minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())


CASES = [
    # tokens, experts, top_k, hidden, intermediate
    (1, 4, 2, 64, 32),
    (7, 8, 2, 48, 40),  # K not a multiple of the tile, N not either
    (33, 4, 1, 32, 64),
    (20, 6, 3, 64, 24),
]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}E{c[1]}k{c[2]}" for c in CASES])
def test_triton_matches_float32_reference(case, dtype):
    x, w13, w2, tw, ti, _, _ = make_inputs(*case, dtype=dtype, seed=sum(case), skew=case[0] > 10)
    out = fused_experts_triton(x, w13, w2, tw, ti, config=FusedMoEConfig(block_m=16, block_n=32, block_k=32))
    assert out.dtype == dtype and out.shape == x.shape
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), reference(x, w13, w2, tw, ti), rtol=rtol, atol=atol)


@pytest.mark.parametrize("activation", ["swigluoai", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_bias_and_activations(activation, dtype):
    x, w13, w2, tw, ti, b13, b2 = make_inputs(9, 4, 2, 32, 32, dtype=dtype, seed=5, bias=True)
    out = fused_experts_triton(x, w13, w2, tw, ti, activation, b13, b2, config=FusedMoEConfig(16, 32, 32))
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(
        out.float(), reference(x, w13, w2, tw, ti, activation, b13, b2), rtol=rtol, atol=atol
    )


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("bias", [False, True])
def test_torch_path_matches_reference(activation, bias):
    x, w13, w2, tw, ti, b13, b2 = make_inputs(
        25, 6, 2, 48, 40, dtype=torch.float32, seed=11, bias=bias, skew=True
    )
    out = fused_experts_torch(x, w13, w2, tw, ti, activation, b13, b2)
    torch.testing.assert_close(out, reference(x, w13, w2, tw, ti, activation, b13, b2), rtol=1e-5, atol=1e-5)


def test_dispatch_follows_fused_ops_mode(monkeypatch):
    import kvllm.layers.moe.fused_moe_triton as triton_path

    calls = []
    monkeypatch.setattr(triton_path, "fused_experts_triton", lambda *a, **k: calls.append(1) or a[0])
    x, w13, w2, tw, ti, _, _ = make_inputs(3, 4, 2, 32, 16, dtype=torch.float32, seed=2)
    with fused_ops_mode("0"):
        fused_experts(x, w13, w2, tw, ti)
    assert not calls
    with fused_ops_mode("1"):
        fused_experts(x, w13, w2, tw, ti)
    assert calls == [1]


def test_bad_shapes_are_rejected():
    x, w13, w2, tw, ti, _, _ = make_inputs(3, 4, 2, 32, 16, dtype=torch.float32, seed=3)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_experts_torch(x, w13, w2[:, :, :8], tw, ti)
    with pytest.raises(ValueError, match="topk_weights and topk_ids"):
        fused_experts_torch(x, w13, w2, tw[:2], ti)
    with pytest.raises(ValueError, match="activation"):
        fused_experts_torch(x, w13, w2, tw, ti, activation="relu")
    with pytest.raises(ValueError, match="must match hidden_states"):
        fused_experts_triton(x, w13.half(), w2, tw, ti)


def test_softmax_topk_and_topk_softmax():
    g = torch.Generator().manual_seed(0)
    logits = randn(10, 6, generator=g)
    probs = torch.softmax(logits, -1)
    w, ids = softmax_topk(logits, 2, renormalize=False)
    assert ids.dtype == torch.int32
    expected = torch.sort(probs, -1, descending=True)
    torch.testing.assert_close(w, expected.values[:, :2])
    assert torch.equal(ids.long(), expected.indices[:, :2])
    w_norm, _ = softmax_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(w_norm, w / w.sum(-1, keepdim=True))
    w_after, ids_after = topk_softmax(logits, 3)
    top = torch.sort(logits, -1, descending=True)
    torch.testing.assert_close(w_after, torch.softmax(top.values[:, :3], -1))
    assert torch.equal(ids_after.long(), top.indices[:, :3])
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(logits, 7, renormalize=True)


@pytest.mark.parametrize(
    "names", [("gate_proj", "down_proj", "up_proj"), ("w1", "w2", "w3")], ids=["qwen", "mixtral"]
)
def test_layer_loads_per_expert_checkpoint_names(names):
    num_experts, hidden, inter = 3, 16, 8
    layer = FusedMoE(num_experts, 2, hidden, inter, renormalize=True)
    g = torch.Generator().manual_seed(1)
    gate_name, down_name, up_name = names
    shapes = {gate_name: (inter, hidden), up_name: (inter, hidden), down_name: (hidden, inter)}
    checkpoint = {
        f"mlp.experts.{e}.{n}.weight": randn(*shapes[n], generator=g)
        for e in range(num_experts)
        for n in names
    }
    params = dict(layer.named_parameters(prefix="mlp.experts"))
    mapping = FusedMoE.make_expert_params_mapping(gate_name, down_name, up_name, num_experts)
    filled = set()
    for name, tensor in checkpoint.items():
        for param_prefix, fragment, expert_id, shard_id in mapping:
            if fragment in name:
                param_name = name.replace(fragment, param_prefix)
                params[param_name].weight_loader(params[param_name], tensor, shard_id, expert_id)
                filled.add(param_name)
                break
        else:
            raise AssertionError(f"{name} not mapped")
    assert filled == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
    for e in range(num_experts):
        w13 = layer.w13_weight[e]
        assert torch.equal(w13[:inter], checkpoint[f"mlp.experts.{e}.{gate_name}.weight"])
        assert torch.equal(w13[inter:], checkpoint[f"mlp.experts.{e}.{up_name}.weight"])
        assert torch.equal(layer.w2_weight[e], checkpoint[f"mlp.experts.{e}.{down_name}.weight"])
    x = randn(5, hidden, generator=g)
    logits = randn(5, num_experts, generator=g)
    tw, ti = softmax_topk(logits, 2, renormalize=True)
    with fused_ops_mode("0"):
        out = layer(x, logits)
    torch.testing.assert_close(
        out, reference(x, layer.w13_weight, layer.w2_weight, tw, ti), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight_loader(layer.w2_weight, torch.zeros(inter, hidden), "w2", 0)
    with pytest.raises(ValueError, match="expert id"):
        layer.weight_loader(layer.w2_weight, torch.zeros(hidden, inter), "w2", num_experts)
