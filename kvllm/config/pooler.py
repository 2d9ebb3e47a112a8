"""PoolerConfig and the runner / convert choices of a pooling engine, with vLLM 0.22's names (no torch).

`--runner pooling` turns the engine into an embedding engine: every request is one prefill, and the
hidden states of its prompt are pooled into one vector (`LLM.embed`, `/v1/embeddings`). A model whose
architecture is a pooling model (BertModel) runs that way by default; a causal LM (Qwen3, Llama) is
converted (`--convert embed`, what `--runner pooling` implies), as vLLM's adapters do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
SEQ_POOLING_TYPES = ("CLS", "LAST", "MEAN")

# vLLM 0.22 PoolerConfig fields kvllm has no feature behind, and what to do instead.
_UNSUPPORTED_FIELDS = {
    "tok_pooling_type": "kvllm pools each prompt into one vector (seq_pooling_type); token-wise pooling "
    "(ALL, STEP) is not available",
    "enable_chunked_processing": "kvllm embeds prompts of up to max_model_len tokens; longer inputs are "
    "rejected, not split and averaged",
    "max_embed_len": "kvllm embeds prompts of up to max_model_len tokens",
    "logit_mean": "kvllm has no classification models (score calibration does not apply)",
    "logit_sigma": "kvllm has no classification models (score calibration does not apply)",
    "logit_bias": "kvllm has no classification models (score calibration does not apply)",
    "logit_scale": "kvllm has no classification models (score calibration does not apply)",
    "step_tag_id": "kvllm has no reward models",
    "returned_token_ids": "kvllm has no reward models",
}


@dataclass
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into its embedding (vLLM's PoolerConfig).

    `pooling_type` / `seq_pooling_type`: CLS (first token), LAST (last token) or MEAN (average of every
    prompt token); None = the model's default (sentence-transformers' modules.json where the folder has
    one, else CLS for BERT and LAST for a converted causal LM). `use_activation`: for embeddings,
    L2-normalize the vector (None = True, or what the folder's modules.json says). `dimensions`: the
    default output size for matryoshka models (requests may ask for their own). `task`: only "embed".
    """

    task: str | None = None
    pooling_type: str | None = None
    seq_pooling_type: str | None = None
    use_activation: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.task not in (None, "embed"):
            raise ValueError(
                f"pooler_config.task={self.task!r} is not available; allowed: embed (kvllm has no "
                "classification, scoring or token-wise pooling tasks)"
            )
        if self.pooling_type is not None:
            if self.seq_pooling_type is not None:
                raise ValueError("Cannot set both `pooling_type` and `seq_pooling_type`")
            self.seq_pooling_type, self.pooling_type = self.pooling_type, None
        if self.seq_pooling_type is not None:
            self.seq_pooling_type = str(self.seq_pooling_type).upper()
            if self.seq_pooling_type not in SEQ_POOLING_TYPES:
                raise ValueError(
                    f"pooler_config.pooling_type={self.seq_pooling_type!r} is not available; allowed: "
                    f"{', '.join(SEQ_POOLING_TYPES)} (token-wise ALL / STEP are not)"
                )
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(
                f"pooler_config.use_activation={self.use_activation!r} is not valid; allowed: a bool"
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(
                f"pooler_config.dimensions={self.dimensions!r} is not valid; allowed: an integer >= 1"
            )

    @classmethod
    def from_value(cls, value: PoolerConfig | dict[str, Any] | str) -> PoolerConfig:
        """From a PoolerConfig, a dict or a JSON string (the CLI's `--pooler-config '{...}'`)."""
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f'pooler_config={value!r} is not valid JSON ({exc.msg}); e.g. \'{{"pooling_type": "MEAN"}}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(
                f"pooler_config={value!r} is not valid; allowed: a PoolerConfig, a dict or a JSON object"
            )
        known = {f.name for f in fields(cls)}
        for key in value:
            if key in _UNSUPPORTED_FIELDS:
                raise ValueError(f"pooler_config.{key}: {_UNSUPPORTED_FIELDS[key]}")
            if key not in known:
                raise ValueError(f"pooler_config has no field {key!r}; allowed: {', '.join(sorted(known))}")
        return cls(**value)

    def resolved(self, defaults: dict[str, Any]) -> PoolerConfig:
        """This config with its unset fields taken from `defaults` (the model folder's, the model's)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for key, value in defaults.items():
            if values.get(key) is None:
                values[key] = value
        return PoolerConfig(**values)


def check_runner(runner: str, convert: str) -> None:
    """ValueError naming the field unless runner / convert are values kvllm takes."""
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r} is not valid; allowed: {', '.join(RUNNERS)}")
    if convert == "classify":
        raise ValueError(
            "convert='classify' is not available: kvllm has no classification (sequence-classification) "
            "models; allowed: auto, none, embed"
        )
    if convert not in CONVERTS:
        raise ValueError(f"convert={convert!r} is not valid; allowed: {', '.join(CONVERTS)}")
    if runner == "generate" and convert == "embed":
        raise ValueError("convert='embed' makes a pooling model; use it with runner='pooling' (or 'auto')")
