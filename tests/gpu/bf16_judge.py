"""Judging an engine's bfloat16 greedy run against HF transformers in float32 on the same weights.

A bf16 run cannot equal a float32 one, and fixed gaps do not say how far bf16 may move a given model
(a soft-capped Gemma 2 and a MoE whose router flips an expert differ by an order of magnitude). So HF's
own bf16 run of the same weights is the yardstick of bf16 rounding, and both bf16 runs are measured
against HF float32, the reference. Both HF runs are teacher-forced on the prompt plus the engine's own
tokens, so every generated step is judged, also after a legitimate flip (on that shared prefix the
float32 argmax is "the reference's token"; until the first flip this is HF float32's greedy sequence).

Per prompt, over every (step, token) the engine returned a logprob for (the chosen token and its top-k):
- `engine_error` = max |engine logprob - fp32 logprob|, `hf_bf16_error` = the same for HF bf16 on the
  same (step, token) pairs; the engine must stay within `allowed_error` = max(ERROR_RATIO x
  hf_bf16_error, ERROR_FLOOR) (the floor: bf16 keeps 8 significant bits, one step of a logit between 4 and 8 is 0.03).
- greedy ids: at each step the engine's token is the fp32 argmax, or the step is a near-tie: fp32's gap
  from its argmax to the engine's token is at most `tie_bound` = 2 x min(engine_error, hf_bf16_error).
  Two logprobs each moved by at most e can swap only if they were less than 2e apart, and a swap is
  bf16 noise only if both engines' measured bf16 error reaches it.
- the engine's greedy token is its own most likely one (it logged top-k logprobs beside it).
- on MoE models, an expert choice bf16 can flip: at a step whose logits come from a position where some
  router's float32 gap between its k-th and (k+1)-th expert is at most 2 x HF bf16's own error on that
  router's logits there (`router_near_ties`, the same argument as for tokens), a flipped expert moves the
  step's logprobs by up to whole nats. Such a step may exceed `allowed_error` and flip its token (it is
  listed in `router_excused` with the gap and the error); any other step may not.
The report also names HF float32's smallest router gaps (`fp32_router_margins`), as a diagnosis.

Pure functions on logprob arrays (`judge`) so the rules are unit-tested on the CPU
(tests/unit/test_bf16_judge.py); `hf_logprobs` runs the HF side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

ERROR_RATIO = 3.0
ERROR_FLOOR = 0.05
# The engine's own top-1 and its greedy token come from the same float32 logprobs: equal up to printing.
SELF_ARGMAX_ATOL = 1e-5
TOP_LOGPROBS = 4  # SamplingParams(logprobs=...) for runs judged here: the chosen token plus the top 4


@dataclass
class Flip:
    """A step where the engine's greedy token is not float32's argmax on the same prefix."""

    step: int
    engine_token: int
    fp32_token: int
    fp32_gap: float  # fp32 logprob of its argmax minus that of the engine's token (> 0)
    near_tie: bool  # fp32_gap <= tie_bound (an exact fp32 tie always is one)


@dataclass
class Bf16Judgement:
    """Every number the rules use, for one prompt (serialized into the GPU tests' JSON reports)."""

    prompt_len: int
    steps: int
    engine_error: float
    hf_bf16_error: float
    allowed_error: float
    tie_bound: float
    engine_error_per_step: list[float]
    hf_bf16_error_per_step: list[float]
    flips: list[Flip] = field(default_factory=list)
    hf_bf16_flips: list[int] = field(default_factory=list)  # steps where HF bf16's argmax is not fp32's
    failures: list[str] = field(default_factory=list)
    # MoE models: steps over allowed_error or with a token flip at a router near-tie, and the tie excusing it.
    router_excused: list[dict[str, Any]] = field(default_factory=list)
    # MoE models, as a diagnosis (not a rule): where HF float32's expert choice is closest to flipping.
    fp32_router_margins: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("engine_error_per_step", "hf_bf16_error_per_step"):
            out[key] = [round(v, 5) for v in out[key]]
        out["ok"] = self.ok
        return out


def _as_float(value: Any) -> float:
    return float(getattr(value, "logprob", value))  # kvllm.outputs.Logprob or a plain number


def judge(
    prompt_len: int,
    engine_tokens: Sequence[int],
    engine_logprobs: Sequence[Mapping[int, Any]],
    fp32_logprobs: torch.Tensor,
    bf16_logprobs: torch.Tensor,
    *,
    ratio: float = ERROR_RATIO,
    floor: float = ERROR_FLOOR,
    router_ties: Mapping[int, Mapping[str, Any]] | None = None,
) -> Bf16Judgement:
    """Apply the module's rules to one prompt.

    engine_logprobs[t] maps token id -> logprob (a float or a kvllm Logprob) for step t and must hold
    engine_tokens[t]; fp32_logprobs / bf16_logprobs are HF's [steps, vocab] log-softmax on the prompt
    plus engine_tokens (row t predicts engine_tokens[t]). `router_ties` maps a step to the router
    near-tie at its position (`router_near_ties`): such a step may exceed the allowed error.
    """
    steps = len(engine_tokens)
    if (
        len(engine_logprobs) != steps
        or fp32_logprobs.shape[0] != steps
        or bf16_logprobs.shape != fp32_logprobs.shape
    ):
        raise ValueError(
            f"one row per generated token expected: {steps} tokens, {len(engine_logprobs)} logprob entries, "
            f"fp32 {tuple(fp32_logprobs.shape)}, bf16 {tuple(bf16_logprobs.shape)}"
        )
    fp32, bf16 = fp32_logprobs.float().cpu(), bf16_logprobs.float().cpu()
    failures: list[str] = []
    engine_per_step, hf_per_step = [], []
    for t, (token, entry) in enumerate(zip(engine_tokens, engine_logprobs)):
        if token not in entry:
            raise ValueError(f"step {t}: the engine's logprobs {sorted(entry)} lack its token {token}")
        ids = torch.tensor(list(entry))
        ours = torch.tensor([_as_float(v) for v in entry.values()])
        engine_per_step.append(float((ours - fp32[t, ids]).abs().max()))
        hf_per_step.append(float((bf16[t, ids] - fp32[t, ids]).abs().max()))
        if _as_float(entry[token]) < float(ours.max()) - SELF_ARGMAX_ATOL:
            failures.append(f"step {t}: greedy token {token} is not the engine's own most likely token")
    engine_error = max(engine_per_step, default=0.0)
    hf_error = max(hf_per_step, default=0.0)
    allowed = max(ratio * hf_error, floor)
    tie_bound = 2 * min(engine_error, hf_error)
    router_ties = router_ties or {}
    over = [t for t, e in enumerate(engine_per_step) if e > allowed]
    excused = [{"step": t, "error": engine_per_step[t], **router_ties[t]} for t in over if t in router_ties]
    unexplained = [t for t in over if t not in router_ties]
    if unexplained:
        worst = max(unexplained, key=lambda t: engine_per_step[t])
        failures.append(
            f"logprob error {engine_per_step[worst]:.4f} (step {worst}) above {allowed:.4f} = max({ratio} x HF "
            f"bf16's {hf_error:.4f}, {floor})"
            + (f"; {len(excused)} other step(s) over it at router near-ties" if excused else "")
        )
    flips = []
    fp32_argmax = fp32.argmax(-1).tolist()
    for t, (token, best) in enumerate(zip(engine_tokens, fp32_argmax)):
        if token != best:
            gap = float(fp32[t, best] - fp32[t, token])
            flips.append(Flip(t, token, best, gap, near_tie=gap <= tie_bound))
            if gap > tie_bound and t in router_ties:  # a flipped expert moved this step's logits
                excused.append({"step": t, "token_flip_gap": gap, **router_ties[t]})
            elif gap > tie_bound:
                failures.append(
                    f"step {t}: token {token} where fp32 picks {best}, {gap:.4f} ahead: not a near-tie "
                    f"(bound {tie_bound:.4f} = 2 x min(engine {engine_error:.4f}, HF bf16 {hf_error:.4f}))"
                )
    hf_flips = [t for t, (a, b) in enumerate(zip(bf16.argmax(-1).tolist(), fp32_argmax)) if a != b]
    return Bf16Judgement(
        prompt_len, steps, engine_error, hf_error, allowed, tie_bound, engine_per_step, hf_per_step,
        flips, hf_flips, failures, excused,
    )  # fmt: skip


@torch.inference_mode()
def hf_logprobs(
    path: str, prompt: Sequence[int], tokens: Sequence[int], dtype: torch.dtype, device: str
) -> torch.Tensor:
    """HF's [len(tokens), vocab] float32 log-softmax predicting each of `tokens` after `prompt` (one
    teacher-forced forward over prompt + tokens[:-1])."""
    from tests.hf_reference import _hf_model

    model = _hf_model(path, dtype, device)
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=device)
    logits = model(ids).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, -1).cpu()


_ROUTER_SUFFIXES = (".mlp.router", ".mlp.gate", ".block_sparse_moe.gate")  # gpt-oss, Qwen3-MoE / Mixtral


@torch.inference_mode()
def hf_router_logits(
    path: str, prompt: Sequence[int], tokens: Sequence[int], dtype: torch.dtype, device: str
) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """HF's top-k and, per router (in layer order), its float32 [positions, experts] logits over prompt +
    tokens[:-1]; (0, []) for a dense model."""
    from tests.hf_reference import _hf_model

    model = _hf_model(path, dtype, device)
    top_k = getattr(model.config, "num_experts_per_tok", None)
    routers = [(n, m) for n, m in model.named_modules() if n.endswith(_ROUTER_SUFFIXES)]
    if not top_k or not routers:
        return 0, []
    captured: list[tuple[str, torch.Tensor]] = []

    def hook(name: str):
        def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            captured.append((name, logits.reshape(-1, logits.shape[-1]).float().cpu()))

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in routers]
    try:
        model(torch.tensor([list(prompt) + list(tokens[:-1])], device=device))
    finally:
        for handle in handles:
            handle.remove()
    return top_k, captured


def _router_gaps(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[positions]: each position's gap between its k-th and (k+1)-th router logit."""
    ordered = logits.sort(-1, descending=True).values
    return ordered[:, top_k - 1] - ordered[:, top_k]


def router_near_ties(
    top_k: int,
    fp32: Sequence[tuple[str, torch.Tensor]],
    bf16: Sequence[tuple[str, torch.Tensor]],
    prompt_len: int,
    steps: int,
) -> dict[int, dict[str, Any]]:
    """Per generated step, the router near-tie at the position whose logits give it, if any: a router whose
    float32 gap between its k-th and (k+1)-th expert is at most 2 x HF bf16's largest error on that
    router's logits there (two logits each moved by at most e swap only if less than 2e apart). The
    tightest such router (smallest gap / error) is named. Routers pair up by order (fp32 and bf16 runs of
    one model)."""
    ties: dict[int, dict[str, Any]] = {}
    for (name, a), (_, b) in zip(fp32, bf16, strict=True):
        gaps = _router_gaps(a, top_k)
        errors = (a - b).abs().amax(-1)
        for step in range(steps):
            position = prompt_len - 1 + step
            gap, error = float(gaps[position]), float(errors[position])
            if gap <= 2 * error:
                known = ties.get(step)
                if known is None or gap / max(error, 1e-12) < known["margin"] / max(
                    known["bf16_error"], 1e-12
                ):
                    ties[step] = {"router": name, "position": position, "margin": gap, "bf16_error": error}
    return ties


def fp32_router_margins(
    top_k: int, fp32: Sequence[tuple[str, torch.Tensor]], prompt_len: int, count: int = 5
) -> list[dict[str, Any]]:
    """The `count` smallest gaps between HF float32's k-th and (k+1)-th router logit over prompt + tokens
    (empty for a dense model): a gap of a few bf16 steps is an expert choice bf16 can flip, and a flip
    moves every later logprob. `first_step` is the first generated step whose logits it reaches."""
    margins = []
    for name, logits in fp32:
        for position, gap in enumerate(_router_gaps(logits, top_k).tolist()):
            margins.append((gap, position, name))
    return [
        {
            "margin": gap,
            "position": position,
            "first_step": max(0, position - prompt_len + 1),
            "router": name,
        }
        for gap, position, name in sorted(margins)[:count]
    ]


def judge_against_hf(
    path: str,
    prompt: Sequence[int],
    tokens: Sequence[int],
    logprobs: Sequence[Mapping[int, Any]],
    device: str,
) -> Bf16Judgement:
    """`judge` one engine completion against HF float32, with HF bf16 as the yardstick."""
    fp32 = hf_logprobs(path, prompt, tokens, torch.float32, device)
    bf16 = hf_logprobs(path, prompt, tokens, torch.bfloat16, device)
    top_k, routers_fp32 = hf_router_logits(path, prompt, tokens, torch.float32, device)
    ties = {}
    if routers_fp32:
        _, routers_bf16 = hf_router_logits(path, prompt, tokens, torch.bfloat16, device)
        ties = router_near_ties(top_k, routers_fp32, routers_bf16, len(prompt), len(tokens))
    judgement = judge(len(prompt), tokens, logprobs, fp32, bf16, router_ties=ties)
    judgement.fp32_router_margins = fp32_router_margins(top_k, routers_fp32, len(prompt))
    return judgement


def failure_summary(judgements: Sequence[Bf16Judgement]) -> str:
    """One line per failing prompt, for an assertion message."""
    return "\n".join(f"prompt of {j.prompt_len}: {'; '.join(j.failures)}" for j in judgements if not j.ok)
