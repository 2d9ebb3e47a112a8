"""The EAGLE proposer (vLLM's `eagle`, `eagle3` and `mtp` methods): a draft head on the target's hidden states.

The head's position p reads the target's hidden state at p and the token at p + 1, so each step it runs
over the step's own positions with the input ids shifted by one, gathered from the device token table
after verification wrote the step's emitted tokens there: for a verified request, the position of its
last accepted draft reads the token the rejection sampler emitted, and the positions after it read
rejected drafts (or -1, read as 0) whose KV entries the next drafting steps overwrite before any query
reaches them (attention is causal). The head's output at each sampling request's last emitted row
gives the first draft, and k - 1 decode steps of the head on its own hidden states the rest (chain
drafting). Drafts are greedy (deterministic), so the rejection sampler verifies them with q one-hot:
the output keeps the target's distribution exactly. The head's KV cache shares the target's blocks
(draft_cache.py); the scheduler allocates k lookahead slots per request for the decode steps.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kvllm.attention.backend import AttentionBackend
from kvllm.attention.metadata import CommonAttentionMetadata, KVCacheSpec
from kvllm.config.engine import EngineArgs
from kvllm.config.speculative import SpeculativeConfig
from kvllm.forward_context import set_forward_context
from kvllm.layers.attention import Attention
from kvllm.layers.mla_attention import MLAAttention
from kvllm.models.model_config import ModelConfig
from kvllm.spec_decode.draft_cache import DraftKVCache
from kvllm.utils.dtypes import kv_cache_torch_dtype

logger = logging.getLogger(__name__)


def _checkpoint_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    from kvllm.models.loader.weights import safetensors_files

    names: set[str] = set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def head_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """A head folder's tensors: its *.safetensors, else its *.bin / *.pt (EAGLE-1 heads were published
    as pytorch_model.bin), read on the CPU. Heads are one layer: they fit in host memory at once."""
    from kvllm.models.loader.weights import iterate_safetensors

    if any(folder.glob("*.safetensors")):
        return dict(iterate_safetensors(folder))
    files = sorted([*folder.glob("*.bin"), *folder.glob("*.pt")])
    if not files:
        raise ValueError(f"EAGLE head folder {str(folder)!r} has no *.safetensors, *.bin or *.pt weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return out


def _head_config(folder: Path, target: ModelConfig) -> Any:
    """The head's config.json as a LlamaConfig (published heads say model_type llama, or nothing)."""
    from transformers import LlamaConfig

    file = folder / "config.json"
    if not file.is_file():
        raise ValueError(f"speculative_config.model={str(folder)!r}: an EAGLE head folder needs config.json")
    values = json.loads(file.read_text())
    values.pop("architectures", None)
    values.pop("model_type", None)
    config = LlamaConfig(**values)
    # The head's rope table must cover the target's context (published heads often say 2048).
    config.max_position_embeddings = max(int(config.max_position_embeddings), target.max_model_len)
    for key in ("vocab_size",):
        if getattr(config, key) != getattr(target, key):
            raise ValueError(
                f"EAGLE head {str(folder)!r}: {key}={getattr(config, key)}, the target has {getattr(target, key)}"
            )
    return config


def build_draft_head(
    config: SpeculativeConfig,
    args: EngineArgs,
    target: ModelConfig,
    target_model: nn.Module,
    device: torch.device,
) -> nn.Module:
    """The method's head, loaded on `device` in the target's dtype, attached to the target (its
    embedding and LM head where the checkpoint omits them; EAGLE-3: the hidden states it keeps)."""
    from kvllm.layers.quantization import process_weights_after_loading
    from kvllm.models.loader.hub import resolve_model_path
    from kvllm.models.loader.weights import iterate_safetensors

    if config.method == "mtp":
        from kvllm.models.deepseek_mtp import DeepSeekMTP

        if target.architecture not in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
            raise ValueError(
                f"speculative_config.method='mtp' runs DeepSeek-V3's MTP layers; the target is {target.architecture}"
            )
        folder = Path(target.model_path)
        names = _checkpoint_names(folder)
        first = target.hf_config.num_hidden_layers
        with torch.device(device), _default_dtype(target.dtype):
            head: nn.Module = DeepSeekMTP(
                target.hf_config, f"model.layers.{first}.embed_tokens.weight" in names
            )
    else:
        folder = Path(
            resolve_model_path(
                config.model or "",
                config.revision,
                "EAGLE head",
                cache_dir=args.download_dir,
                token=args.hf_token,
            )
        )
        hf_config = _head_config(folder, target)
        tensors = head_tensors(folder)
        names = {n[len("model.") :] if n.startswith("model.") else n for n in tensors}
        with torch.device(device), _default_dtype(target.dtype):
            if config.method == "eagle":
                from kvllm.models.llama_eagle import EagleLlamaForCausalLM

                head = EagleLlamaForCausalLM(
                    hf_config, "embed_tokens.weight" in names, "lm_head.weight" in names, "fc.bias" in names
                )
            else:
                from kvllm.models.llama_eagle3 import Eagle3LlamaForCausalLM

                if not hasattr(target_model, "set_aux_hidden_state_layers"):
                    raise ValueError(
                        f"speculative_config.method='eagle3' needs a Llama-family target; {target.architecture} "
                        "does not expose its auxiliary hidden states"
                    )
                head = Eagle3LlamaForCausalLM(
                    hf_config,
                    target.hf_config.num_hidden_layers,
                    "embed_tokens.weight" in names,
                    "d2t" in names,
                )
    try:
        head.load_weights(iterate_safetensors(folder) if config.method == "mtp" else tensors.items())
    except ValueError as exc:
        raise ValueError(f"speculative_config ({config.method}) {str(folder)!r}: {exc}") from None
    process_weights_after_loading(head)
    head.attach_target(target_model)
    return head.eval().requires_grad_(False)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class EagleProposer:
    """Runs the head over each step's tokens and drafts k tokens per sampling request (worker side)."""

    def __init__(
        self,
        args: EngineArgs,
        config: SpeculativeConfig,
        target: ModelConfig,
        target_model: nn.Module,
        device: torch.device,
        attn_backend: type[AttentionBackend],
        target_spec: KVCacheSpec,
        bind: Callable[[Attention | MLAAttention], None],
    ) -> None:
        self.k = config.num_speculative_tokens
        self.method = config.method
        self.device = device
        self.target_model = target_model
        self.head = build_draft_head(config, args, target, target_model, device)
        if target_spec.use_mla:  # MTP on an MLA target: its layer's latent cache is the target's kind
            spec = target_spec
        else:
            layer = next(m for m in self.head.modules() if isinstance(m, Attention))
            spec = KVCacheSpec(
                block_size=target_spec.block_size,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_size,
                dtype=kv_cache_torch_dtype(args.kv_cache_dtype, target.dtype),
                kv_cache_dtype=args.kv_cache_dtype,
            )
        self.cache = DraftKVCache(self.head, attn_backend, spec, bind, device)
        self.max_model_len = target.max_model_len
        logger.info(
            "%s head from %s proposes %d tokens per step", config.method, config.model or target.model, self.k
        )

    def attach_target(self, target_model: nn.Module) -> None:
        """Read a (re)loaded target."""
        self.target_model = target_model
        self.head.attach_target(target_model)

    def bytes_per_block(self) -> int:
        return self.cache.bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int, max_num_reqs: int, max_num_tokens: int) -> None:
        self.cache.initialize(num_blocks, max_num_reqs, max_num_tokens, self.max_model_len)

    def run_step_tokens(
        self,
        hidden: torch.Tensor,
        token_index: torch.Tensor,
        positions: torch.Tensor,
        common: CommonAttentionMetadata,
        token_table: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the step's T tokens: hidden [T, H] the target's (final) hidden states,
        token_index int64 [T] each token's flat slot in the token table. Returns the head's
        (logit-side, next-step) hidden states [T, H]."""
        num = token_index.shape[0]
        flat = token_table.view(-1)
        shifted = flat.index_select(0, (token_index + 1).clamp_max_(flat.numel() - 1)).long().clamp_min_(0)
        if self.method == "eagle3":
            target_hidden = self.target_model.aux_hidden_states()[:num]
        else:
            target_hidden = hidden[:num]
        with set_forward_context(self.cache.build(common)):
            return self.head(shifted, positions[:num], self.head.combine_hidden_states(target_hidden))

    def propose(
        self,
        logit_hidden: torch.Tensor,
        next_hidden: torch.Tensor,
        positions: np.ndarray,
        rows: np.ndarray,
        limits: np.ndarray,
        block_table: np.ndarray,
        block_table_gpu: torch.Tensor,
    ) -> list[list[int]]:
        """Up to k drafts per request: request r's head output row (gathered into `logit_hidden[r]`,
        `next_hidden[r]`) sits at position `positions[r]` of token-table row `rows[r]`; its slots end
        before `limits[r]` (allocated blocks, max_model_len), so it drafts at most limits[r] - positions[r]
        tokens (the first needs no new slot, each further one the slot of the step before it)."""
        num = len(rows)
        out = torch.full((num, self.k), -1, dtype=torch.int64, device=self.device)
        ids = self.head.draft_token_ids(logit_hidden)
        out[:, 0] = ids
        counts = np.ones(num, dtype=np.int64)
        active = np.arange(num)
        hidden = next_hidden
        for j in range(1, self.k):
            keep = positions[active] + j < limits[active]
            if not keep.all():
                index = torch.from_numpy(np.flatnonzero(keep)).to(self.device)
                ids, hidden = ids[index], hidden[index]
                active = active[keep]
            if not len(active):
                break
            pos = positions[active] + j
            common = self.cache.decode_metadata(pos, rows[active], block_table, block_table_gpu)
            with set_forward_context(self.cache.build(common)):
                logit_h, hidden = self.head(
                    ids, torch.from_numpy(pos.astype(np.int32)).to(self.device), hidden, j
                )
            ids = self.head.draft_token_ids(logit_h, j)
            out[torch.from_numpy(active).to(self.device), j] = ids
            counts[active] += 1
        host = out.tolist()
        return [row[:c] for row, c in zip(host, counts.tolist())]
