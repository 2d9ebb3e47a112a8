"""The host work serialised behind each verification step, pinned by counted work (never by time).

Speculation schedules without overlap, so whatever the host does between a verification's result
and the next launch adds to every step: the n-gram lookup's scan of the context and the reads of
device results are counted here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvllm.spec_decode.ngram import NgramProposer


def reference_propose(p: NgramProposer, token_ids: list[int], max_drafts: int | None) -> list[int]:
    """The lookup by its definition: every window of each n, longest n first."""
    k = p.k if max_drafts is None else min(p.k, max_drafts)
    num = len(token_ids)
    if k <= 0 or num <= p.min_n:
        return []
    for n in range(min(p.max_n, num - 1), p.min_n - 1, -1):
        suffix = token_ids[num - n :]
        ends = [e for e in range(n, num) if token_ids[e - n : e] == suffix]
        if ends:
            full = [e for e in ends if e <= num - k]
            start = full[-1] if full else ends[0]
            return token_ids[start : start + k]
    return []


def test_ngram_lookup_matches_its_definition():
    rng = random.Random(0)
    for _ in range(3000):
        min_n = rng.randint(1, 3)
        p = NgramProposer(min_n, rng.randint(min_n, 5), rng.randint(1, 5))
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        max_drafts = rng.choice([None, rng.randint(0, 5)])
        assert p.propose(tokens, max_drafts) == reference_propose(p, tokens, max_drafts), (tokens, max_drafts)


@pytest.mark.parametrize("repeats", [8, 32])
def test_ngram_lookup_scans_the_context_once(repeats):
    """One compare per context token, plus the candidates' backward extension: on the benchmark's
    repetitive prompt (a 64-token run repeated) at most 3 extra compares per occurrence of the last
    token, where comparing every window of n = 4..1 costs 10 per token."""
    rng = random.Random(1)
    run = [rng.randrange(3, 100000) for _ in range(64)]
    tokens = run * repeats + run[:5]
    p = NgramProposer(1, 4, 3)
    assert p.propose(tokens) == run[5:8]
    num = len(tokens)
    occurrences = int((np.asarray(tokens[:-1]) == tokens[-1]).sum())
    assert p.num_compared <= (num - 1) + 3 * occurrences
    assert p.num_compared < 1.1 * num


# Ops that read a device value back on the host (a sync on a GPU), or build a tensor from host data
# (from pageable memory: a blocking copy, which waits for the forward pass the verification follows).
# torch.repeat_interleave with a tensor of counts and no output size reads its total back.
_SYNCING_OPS = {
    "aten.lift_fresh",
    "aten.repeat_interleave",
    "aten.nonzero",
    "aten._local_scalar_dense",
    "aten.item",
}
# Ops that return a view or the tensor itself: no kernel.
_NO_KERNEL_OPS = {
    "aten.view",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.unbind",
    "aten.detach_",
    "aten.to",
    "aten.split",
}


def test_verification_launches_few_ops_and_never_syncs(tmp_path, monkeypatch):
    """A verification step on the CPU, every torch op of verify_drafts counted: no op that would
    wait for the device, at most 22 kernels (the LM head over the drafts' rows and the rejection
    sampler's; 31 and two syncs before the draft layout was uploaded with the step), one result
    tensor copied to the host, and two host reads of device results per step (the step's samples
    and the verified runs; three before)."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import kvllm.spec_decode.ngram as ngram
    import kvllm.worker.model_runner as model_runner
    from kvllm import LLM, SamplingParams
    from tests.model_factory import make_tiny_qwen3

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    counter = CountOps()
    verifications = []
    original_verify = model_runner.verify_drafts

    def counted_verify(*args, **kwargs):
        with counter:
            pending = original_verify(*args, **kwargs)
        verifications.append(pending)
        return pending

    monkeypatch.setattr(model_runner, "verify_drafts", counted_verify)
    drafts = random.Random(0)

    def random_drafts(self, token_ids, max_drafts=None):  # rarely accepted: one verification per step
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        return [drafts.randrange(3, 400) for _ in range(max(k, 0))]

    monkeypatch.setattr(ngram.NgramProposer, "propose", random_drafts)
    llm = LLM(
        str(make_tiny_qwen3(tmp_path)),
        device="cpu",
        dtype="float32",
        max_model_len=512,
        enable_prefix_caching=False,
        seed=0,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    )
    engine = llm.llm_engine
    engine.add_request(
        "r",
        {"prompt_token_ids": [5, 6, 7] * 20},
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    )
    for _ in range(3):
        engine.step()
    reads = collections.Counter()
    for name in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            import traceback

            caller = traceback.extract_stack(limit=2)[0].filename
            if not caller.endswith("cpu_attn_impl.py"):  # the CPU backend's own metadata, no GPU's
                reads["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    verifications.clear()
    counter.ops.clear()
    steps = 16
    for _ in range(steps):
        engine.step()
    monkeypatch.undo()
    assert len(verifications) == steps  # every step verified drafts
    assert not _SYNCING_OPS & set(counter.ops), counter.ops
    kernels = sum(n for op, n in counter.ops.items() if op not in _NO_KERNEL_OPS) / steps
    assert kernels <= 22, counter.ops
    assert all(not hasattr(v, "num_accepted") for v in verifications)  # one copy: the runs' tokens
    assert reads["n"] == 2 * steps
