"""PoolingParams: what one embedding request asks of the pooler (vLLM's names). No torch is imported here."""

from __future__ import annotations

from dataclasses import dataclass

from kvllm.sampling_params import RequestOutputKind


@dataclass
class PoolingParams:
    """Settings of one pooling (embedding) request.

    `dimensions`: keep the first `dimensions` values of the embedding (then normalize), for models
    trained for it (matryoshka: `is_matryoshka` or `matryoshka_dimensions` in config.json); other models
    refuse it. `use_activation`: L2-normalize the embedding; None = the model's PoolerConfig.
    `truncate_prompt_tokens`: keep the last k prompt tokens (-1: the last max_model_len), as in
    SamplingParams.
    """

    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    # A pooling request is one sequence with one (final) output; the async engine reads these.
    n = 1
    output_kind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions={self.dimensions!r} is not valid; allowed: an integer >= 1")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation={self.use_activation!r} is not valid; allowed: a bool or None")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens={t!r} is not valid; allowed: an integer >= 1, or -1")
