"""The mixture-of-experts feed-forward in plain torch: the reference for the Triton path, and the CPU path.

Shapes (vLLM's layout): hidden_states [T, H]; w13 [E, 2I, H] holding each expert's gate rows then its
up rows; w2 [E, H, I]; optional biases w13_bias [E, 2I], w2_bias [E, H]; topk_weights [T, k] and
topk_ids [T, k] from a router. out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# gpt-oss's clamped SwiGLU ("swigluoai" in vLLM): glu = gate * sigmoid(alpha * gate), out = (up + 1) * glu.
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0
ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai")


def apply_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[..., 2I] (gate then up) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))
    raise ValueError(f"MoE activation {activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")


def check_fused_experts_args(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
) -> None:
    """ValueError naming the first argument whose shape does not fit the others."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [num_tokens, hidden], got {tuple(hidden_states.shape)}")
    num_tokens, hidden = hidden_states.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [num_experts, 2 * intermediate, {hidden}], got {tuple(w13.shape)}")
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (num_experts, hidden, intermediate):
        raise ValueError(f"w2 must be [{num_experts}, {hidden}, {intermediate}], got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights and topk_ids must both be [{num_tokens}, top_k], got "
            f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}"
        )
    if w13_bias is not None and w13_bias.shape != (num_experts, 2 * intermediate):
        raise ValueError(f"w13_bias must be [{num_experts}, {2 * intermediate}], got {tuple(w13_bias.shape)}")
    if w2_bias is not None and w2_bias.shape != (num_experts, hidden):
        raise ValueError(f"w2_bias must be [{num_experts}, {hidden}], got {tuple(w2_bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"MoE activation {activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )


def fused_experts_torch(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Loop over the experts that got tokens; each runs its tokens as one batch (as HF's MoE blocks do).

    Computes in the inputs' dtype, the routing weight cast to it before the product, and the sum over
    the k experts of a token in that dtype, as HF transformers does. Returns [T, H].
    """
    check_fused_experts_args(hidden_states, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    out = torch.zeros_like(hidden_states)
    weights = topk_weights.to(hidden_states.dtype)
    flat_ids = topk_ids.reshape(-1).long()
    # One host sync for the list of used experts; fine for the reference and the CPU path.
    for expert in torch.unique(flat_ids).tolist():
        token_index, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        x = hidden_states[token_index]
        gate_up = F.linear(x, w13[expert], None if w13_bias is None else w13_bias[expert])
        y = F.linear(
            apply_activation(gate_up, activation), w2[expert], None if w2_bias is None else w2_bias[expert]
        )
        out.index_add_(0, token_index, y * weights[token_index, slot, None])
    return out
