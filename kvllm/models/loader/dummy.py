"""Random weights of the right shapes, for benchmarks without a checkpoint (vLLM's load_format=dummy)."""

from __future__ import annotations

import torch
from torch import nn

DUMMY_STD = 0.02  # HF's usual initializer_range: activations stay O(1) through the layers


@torch.no_grad()
def init_dummy_weights(model: nn.Module, std: float = DUMMY_STD) -> None:
    """Norm weights 1, biases 0, everything else N(0, std); quantized layers' tensors (packed integers,
    fp8 values, scales) are filled by the `dummy_init` their quantization method attached.

    Drawn on the parameters' device from a generator seeded with torch's seed (`torch.manual_seed`),
    in parameter order: the same seed gives the same weights on the same kind of device, and the
    global random state is left alone.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        dummy_init = getattr(param, "dummy_init", None)
        if dummy_init is not None:
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(torch.initial_seed())
            dummy_init(param, generators[param.device])
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias") or name.endswith(".sinks"):
            param.zero_()
        else:
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(torch.initial_seed())
            param.normal_(0.0, std, generator=generators[param.device])
