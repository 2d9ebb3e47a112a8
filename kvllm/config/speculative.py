"""SpeculativeConfig: vLLM's `speculative_config` (`--speculative-config` / `-sc`, `LLM(speculative_config=)`).

Taken as vLLM takes it: a dict or a JSON string with `method`, `num_speculative_tokens`, `model`,
`prompt_lookup_min` / `prompt_lookup_max`, `draft_tensor_parallel_size`... Every key vLLM knows is
either applied or answered with an error naming it; an unknown key is an error listing the known ones.
No torch is imported here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# Methods kvllm runs, and the ones vLLM has that kvllm does not (yet), with what to use instead.
SUPPORTED_METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3", "mtp")
# Methods drafting with attention layers of their own: their KV cache shares the target's blocks.
DRAFT_KV_CACHE_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# vLLM's older per-model MTP names, all meaning the checkpoint's own MTP layers.
MTP_ALIASES = ("deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "qwen3_next_mtp")
UNAVAILABLE_METHODS = {
    "mlp_speculator": "MLP speculator heads",
    "suffix": "suffix decoding",
    "ngram_gpu": "the GPU n-gram proposer",
    "custom_class": "custom proposer classes",
    "dflash": "DFlash drafters",
}
# vLLM keys that only make sense with a feature kvllm lacks: accepted at these values only.
_FIXED_KEYS: dict[str, tuple[Any, ...]] = {
    "draft_tensor_parallel_size": (None, 1),
    "tensor_parallel_size": (None, 1),
    "quantization": (None,),
    "disable_padded_drafter_batch": (False, True),  # no effect: kvllm pads no drafter batch
    "parallel_drafting": (False,),
    "rejection_sample_method": ("standard",),
    "speculative_token_tree": (None,),
    "code_revision": (None,),
    "draft_load_config": (None,),
    "moe_backend": (None,),
    "attention_backend": (None,),
    "use_local_argmax_reduction": (False,),
}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both bounds when neither is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated speculative-decoding settings (vLLM's names and defaults)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 0  # n-gram only: the shortest suffix matched
    prompt_lookup_max: int = 0  # n-gram only: the longest suffix matched
    revision: str | None = None
    max_model_len: int | None = None
    enforce_eager: bool | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def uses_draft_kv_cache(self) -> bool:
        """Whether the drafter has attention layers (and lookahead KV slots for its decode steps)."""
        return self.method in DRAFT_KV_CACHE_METHODS

    @property
    def uses_eagle(self) -> bool:
        """EAGLE, EAGLE-3 and MTP heads: they read the target's hidden states (spec_decode/eagle.py)."""
        return self.method in ("eagle", "eagle3", "mtp")

    @classmethod
    def from_value(cls, value: Any, name: str = "speculative_config") -> SpeculativeConfig:
        """Parse a SpeculativeConfig, a dict or a JSON string; ValueError naming the field otherwise."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{name}={value!r} is not valid JSON ({exc.msg}); e.g. "
                    '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"{name}={value!r} is not valid; allowed: a dict or a JSON object")
        return cls._from_dict(dict(value), name)

    @classmethod
    def _from_dict(cls, d: dict[str, Any], name: str) -> SpeculativeConfig:
        own = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - own - set(_FIXED_KEYS))
        if unknown:
            raise ValueError(
                f"{name}: unknown key(s) {', '.join(unknown)}; allowed: "
                f"{', '.join(sorted(own | set(_FIXED_KEYS)))}"
            )
        for key, allowed in _FIXED_KEYS.items():
            if key not in d:
                continue
            given = d.pop(key)
            if given not in allowed:
                raise ValueError(
                    f"{name}.{key}={given!r} is not available in kvllm; allowed: "
                    f"{', '.join(map(repr, allowed))}"
                )
        model = d.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"{name}.model={model!r} is not valid; allowed: a model folder or repo id")
        method = d.get("method")
        if method is None:  # vLLM's inference: a model means a draft model, "ngram" the n-gram proposer
            if model is None:
                raise ValueError(
                    f"{name} needs 'method' (allowed: {', '.join(SUPPORTED_METHODS)}) or a draft 'model'"
                )
            method = "ngram" if model in ("ngram", "[ngram]") else _method_from_model_name(model)
        if method == "[ngram]":
            method = "ngram"
        if method in MTP_ALIASES:
            method = "mtp"
        if method in UNAVAILABLE_METHODS:
            raise ValueError(
                f"{name}.method={method!r}: {UNAVAILABLE_METHODS[method]} are not available in this version "
                f"of kvllm; allowed methods: {', '.join(SUPPORTED_METHODS)} (n-gram prompt lookup needs no "
                "weights; draft_model takes a small model with the target's tokenizer; medusa, eagle and eagle3 "
                "take heads in their published formats; mtp uses the target checkpoint's own MTP layers)"
            )
        if method not in SUPPORTED_METHODS:
            raise ValueError(
                f"{name}.method={method!r} is not valid; allowed: {', '.join(SUPPORTED_METHODS)}"
            )
        k = d.get("num_speculative_tokens")
        if k is None:
            raise ValueError(f"{name}.num_speculative_tokens is required (a positive integer, e.g. 3)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{name}.num_speculative_tokens={k!r} is not valid; allowed: a positive integer")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}.{key}={v!r} is not valid; allowed: a positive integer")
        if method == "ngram":
            if model not in (None, "ngram", "[ngram]"):
                raise ValueError(f"{name}.model={model!r}: method 'ngram' takes no model; remove 'model'")
            model = None
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo > hi:
                raise ValueError(f"{name}: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        elif method == "mtp":  # the target's own layers: a model, if given, is the target's folder
            if lo is not None or hi is not None:
                raise ValueError(f"{name}: prompt_lookup_min/prompt_lookup_max apply to method 'ngram' only")
            lo = hi = 0
        else:
            if model is None:
                what = {
                    "medusa": "a folder of Medusa heads (FasterDecoding/Medusa's format)",
                    "eagle": "a folder of an EAGLE head (SafeAILab/EAGLE's format: config.json and safetensors)",
                    "eagle3": "a folder of an EAGLE-3 head (SafeAILab/EAGLE's format: config.json and safetensors)",
                }.get(
                    method, "a model folder (or repo id) that kvllm loads, with the target model's tokenizer"
                )
                raise ValueError(f"{name}.model is required with method {method!r}: {what}")
            if lo is not None or hi is not None:
                raise ValueError(
                    f"{name}: prompt_lookup_min/prompt_lookup_max apply to method 'ngram' only, not {method!r}"
                )
            lo = hi = 0
        max_len = d.get("max_model_len")
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
            raise ValueError(f"{name}.max_model_len={max_len!r} is not valid; allowed: a positive integer")
        return cls(
            method=method,
            num_speculative_tokens=k,
            model=model,
            prompt_lookup_min=lo,
            prompt_lookup_max=hi,
            revision=d.get("revision"),
            max_model_len=max_len,
            enforce_eager=d.get("enforce_eager"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _method_from_model_name(model: str) -> str:
    """The method a model's name gives away (older vLLM's inference: EAGLE and Medusa heads are named
    so); any other model is a draft model."""
    name = model.lower()
    for marker, method in (
        ("eagle3", "eagle3"),
        ("eagle-3", "eagle3"),
        ("eagle", "eagle"),
        ("medusa", "medusa"),
    ):
        if marker in name:
            return method
    return "draft_model"


def resolve_speculative_config(
    speculative_config: Any, speculative_decoding: Any
) -> SpeculativeConfig | None:
    """The engine's SpeculativeConfig from vLLM's `speculative_config` and the seed's alias.

    `speculative_decoding` is a method name (the rest of the settings then come from
    `speculative_config`) or a whole config like `speculative_config`; both given must agree.
    """
    if speculative_decoding is None:
        return None if speculative_config is None else SpeculativeConfig.from_value(speculative_config)
    if isinstance(speculative_decoding, str) and not speculative_decoding.lstrip().startswith("{"):
        method = speculative_decoding
        rest: dict[str, Any] = {}
        if speculative_config is not None:
            parsed = speculative_config
            if isinstance(parsed, SpeculativeConfig):
                parsed = parsed.to_dict()
            elif isinstance(parsed, str):
                parsed = SpeculativeConfig.from_value(parsed).to_dict()
            rest = dict(parsed)
        if rest.get("method", method) != method:
            raise ValueError(
                f"speculative_decoding={method!r} and speculative_config.method={rest['method']!r} disagree; "
                "give the method once"
            )
        if "num_speculative_tokens" not in rest:
            needs = "num_speculative_tokens" + (", model" if method != "ngram" else "")
            raise ValueError(
                f"speculative_decoding={method!r} names a method only; it also needs {needs}: pass them as "
                f"speculative_config={{'method': {method!r}, 'num_speculative_tokens': 3"
                + (", 'model': PATH" if method != "ngram" else "")
                + "} (vLLM's name)"
            )
        return SpeculativeConfig.from_value({**rest, "method": method}, "speculative_decoding")
    config = SpeculativeConfig.from_value(speculative_decoding, "speculative_decoding")
    if speculative_config is not None and SpeculativeConfig.from_value(speculative_config) != config:
        raise ValueError("speculative_decoding and speculative_config disagree; give one of them")
    return config
