"""Structured outputs on a random-weight Qwen3 with the real Qwen3 tokenizer, sampled at temperature 1.

Random weights cannot produce a JSON document, an address or an expression by chance, so every output
that parses and validates proves the constraint; the unconstrained runs show it does not happen anyway.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from kvllm import LLM, SamplingParams
from kvllm.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        # A pattern, not just a length: xgrammar's JSON strings (so vLLM's) let a raw tab through,
        # which strict JSON parsers refuse.
        "name": {"type": "string", "pattern": "^[A-Za-z][a-z ]{0,7}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "tags"],
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["Paris", "Rome", "Madrid", "a longer answer with spaces"]
# Sums of one to four numbers of up to three digits; the same language as EXPRESSION below.
GRAMMAR = r"""
root ::= number (("+" | "-") number){0,3}
number ::= [1-9] [0-9]{0,2}
"""
EXPRESSION = re.compile(r"[1-9][0-9]{0,2}([+-][1-9][0-9]{0,2}){0,3}")
NUM = 100


def _tiny_llm(path, kv_cache_memory_bytes: int = 1 << 24, **kwargs) -> LLM:
    return LLM(
        str(path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=kv_cache_memory_bytes, **kwargs
    )


@pytest.fixture(scope="module")
def llm(tiny_qwen3_real_tokenizer_path) -> LLM:
    return _tiny_llm(tiny_qwen3_real_tokenizer_path, kv_cache_memory_bytes=1 << 25)


@pytest.fixture(scope="module")
def llm_grammar_process(tiny_qwen3_real_tokenizer_path) -> LLM:
    """The matchers in the grammar process (grammar_process=True)."""
    llm = _tiny_llm(tiny_qwen3_real_tokenizer_path, kv_cache_memory_bytes=1 << 25, grammar_process=True)
    yield llm
    llm.llm_engine.shutdown()


# Tests that run with the matchers on the engine's thread and in the grammar process.
BOTH = pytest.mark.parametrize("engine", ["llm", "llm_grammar_process"])


def _generate(llm: LLM, constraint: StructuredOutputsParams | None, max_tokens: int, num: int = NUM) -> list:
    """`num` sequences of one prompt in one batch (n=num: the prompt is computed once)."""
    params = SamplingParams(n=num, temperature=1.0, max_tokens=max_tokens, structured_outputs=constraint)
    (out,) = llm.generate(["Tell me about"], params, use_tqdm=False)
    return out.outputs


def _valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@BOTH
def test_every_constraint_holds_every_time_and_nothing_holds_without(engine, request):
    """100 sequences per constraint (JSON schema, regex, choice, grammar), all in one batch."""
    llm = request.getfixturevalue(engine)
    cases = [
        (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), lambda t: _valid_json(t), 120),
        (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None, 40),
        (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES, 20),
        (StructuredOutputsParams(grammar=GRAMMAR), lambda t: EXPRESSION.fullmatch(t) is not None, 40),
    ]
    params = [
        SamplingParams(n=NUM, temperature=1.0, max_tokens=max_tokens, structured_outputs=constraint)
        for constraint, _, max_tokens in cases
    ]
    outs = llm.generate(["Tell me about"] * len(cases), params, use_tqdm=False)
    for (constraint, check, _), out in zip(cases, outs):
        texts = [c.text for c in out.outputs]
        assert len(texts) == NUM
        assert [c.text for c in out.outputs if not (c.finish_reason == "stop" and check(c.text))] == [], (
            constraint
        )
        assert len(set(texts)) > (NUM // 2 if constraint.kind == "json" else 2)  # sampled, not forced
    (plain,) = llm.generate(
        ["Tell me about"], SamplingParams(n=20, temperature=1.0, max_tokens=40), use_tqdm=False
    )
    for _, check, _ in cases:
        assert not any(check(c.text) for c in plain.outputs)


@BOTH
def test_a_structural_tag_holds_every_time(engine, request):
    """A tool call as a structural tag (vLLM's structured_outputs.structural_tag): its begin and end
    strings around the schema's JSON, in 50 of 50 samples; none of 20 unconstrained ones has that form."""
    llm = request.getfixturevalue(engine)
    content = {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1}
    tag = {"type": "tag", "begin": "<tool_call>", "content": content, "end": "</tool_call>"}
    constraint = StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": tag}))

    def is_call(text: str) -> bool:
        call = re.fullmatch(r"<tool_call>(.*)</tool_call>", text, re.DOTALL)
        return call is not None and _valid_json(call.group(1))

    outs = _generate(llm, constraint, 120, num=50)
    assert [o.text for o in outs if not (o.finish_reason == "stop" and is_call(o.text))] == []
    assert len({o.text for o in outs}) > 25  # sampled, not forced
    (plain,) = llm.generate(
        ["Tell me about"], SamplingParams(n=20, temperature=1.0, max_tokens=60), use_tqdm=False
    )
    assert not any(is_call(o.text) for o in plain.outputs)


def test_json_object_parses(llm):
    outs = _generate(llm, StructuredOutputsParams(json_object=True, disable_any_whitespace=True), 40, num=20)
    finished = [o.text for o in outs if o.finish_reason == "stop"]
    assert finished
    # strict=False: xgrammar's JSON strings let raw tabs through (see SCHEMA)
    assert all(isinstance(json.loads(t, strict=False), dict) for t in finished)
    assert all(o.text.startswith("{") for o in outs)  # those cut by max_tokens too


def test_overlapped_scheduling_gives_the_same_tokens(tiny_qwen3_real_tokenizer_path):
    """Seeded requests: the mask of step N+1 must see step N's token, with or without overlap."""
    texts = {}
    for async_scheduling in (False, True):
        llm = _tiny_llm(tiny_qwen3_real_tokenizer_path, async_scheduling=async_scheduling)
        params = [
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=100,
                structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
            )
            if i % 2
            else SamplingParams(temperature=1.0, seed=i, max_tokens=int(5 + i))
            for i in range(8)
        ]
        outs = llm.generate(["Tell me about"] * len(params), params, use_tqdm=False)
        texts[async_scheduling] = [o.outputs[0].text for o in outs]
    assert texts[True] == texts[False]
    assert all(_valid_json(t) for t in texts[True][1::2])


def test_masks_advance_each_grammar_once_per_token_before_the_outputs(llm, monkeypatch):
    """With overlap, a step's masks take only the previous step's grammar tokens (its text, stops and
    outputs follow the next launch): every output token advances its grammar exactly once, through
    that early path, and the documents still validate."""
    from kvllm.engine.output_processor import OutputProcessor
    from kvllm.structured_output.request import StructuredOutputRequest

    assert llm.llm_engine.async_scheduling
    counts = {"accepted": 0, "early_steps": 0}
    real_accept, real_early = StructuredOutputRequest.accept_token, OutputProcessor.accept_grammar_tokens

    def accept(self, token_id):
        counts["accepted"] += 1
        return real_accept(self, token_id)

    def early(self, plan, result):
        counts["early_steps"] += 1
        return real_early(self, plan, result)

    monkeypatch.setattr(StructuredOutputRequest, "accept_token", accept)
    monkeypatch.setattr(OutputProcessor, "accept_grammar_tokens", early)
    outs = _generate(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), 60, num=12)
    assert counts["accepted"] == sum(len(o.token_ids) for o in outs)
    assert counts["early_steps"] >= max(len(o.token_ids) for o in outs) - 2  # all but the first and last
    finished = [o.text for o in outs if o.finish_reason == "stop"]
    assert finished and all(_valid_json(t) for t in finished)


@BOTH
def test_n_sequences_each_follow_the_grammar(engine, request):
    llm = request.getfixturevalue(engine)
    params = SamplingParams(
        n=6, temperature=1.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=REGEX)
    )
    (out,) = llm.generate(["Tell me about"], params, use_tqdm=False)
    assert len(out.outputs) == 6
    assert all(re.fullmatch(REGEX, c.text) for c in out.outputs)


def test_requests_run_while_a_grammar_compiles(llm, monkeypatch):
    """A request whose grammar is compiling waits alone: the others are scheduled and finish."""
    engine = llm.llm_engine
    manager = engine.structured_output_manager
    release = threading.Event()
    compile_ = manager._compile
    monkeypatch.setattr(manager, "_compile", lambda p: release.wait(30) and compile_(p))
    engine.add_request(
        "slow",
        "Tell me about",
        SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["yes"])),
    )
    engine.add_request("plain", "Tell me about", SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    while "plain" not in finished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert "slow" not in finished and engine.has_unfinished_requests()
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["slow"].outputs[0].text == "yes"


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"json": {"type": "nonsense"}}, "Unsupported type"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "[a-"}, "Unclosed"),
        ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ],
)
@BOTH
def test_invalid_constraints_are_refused_with_the_reason(engine, request, constraint, message):
    llm = request.getfixturevalue(engine)
    with pytest.raises(ValueError, match=message):
        llm.generate(
            ["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False
        )
    assert not llm.llm_engine.has_unfinished_requests()


def _mixed_batch() -> list[SamplingParams]:
    """Seeded rows: JSON schemas (two with n=2, one with a stop string inside the document), regexes
    and unconstrained rows of 80 to 200 tokens."""
    json_constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    rows = []
    for i in range(9):
        if i % 3 == 0:
            row = dict(max_tokens=100, n=2 if i < 6 else 1, structured_outputs=json_constraint)
            row["stop"] = ['"age"'] if i == 3 else None
        elif i % 3 == 1:
            row = dict(max_tokens=40, structured_outputs=StructuredOutputsParams(regex=REGEX))
        else:
            row = dict(max_tokens=40 + 20 * i, ignore_eos=True)
        rows.append(SamplingParams(temperature=1.0, seed=i, **row))
    return rows


def test_grammar_process_gives_the_engine_threads_tokens(tiny_qwen3_real_tokenizer_path, monkeypatch):
    """Seeded, overlapped scheduling on: the same texts with the matchers on the engine's thread and in
    the grammar process, and with overlap off in the process. The KV cache holds 256 tokens, so
    requests are preempted and recomputed (counted), and their grammars must not see a token twice.
    With the process the constrained steps' sampling waits for the masks; with overlap on, the next
    step's start launches it (the engine thread schedules meanwhile), without overlap its result."""
    from kvllm.worker import model_runner

    deferred, by_next_step = [], []
    launch_sampling = model_runner.PendingStepResult.launch_sampling
    launch_deferred = model_runner.ModelRunner.launch_deferred_sampling

    def counting_launch(pending):  # noqa: ANN001, ANN202
        deferred.append(pending.deferred_sampling is not None)
        launch_sampling(pending)

    def counting_next_step(runner):  # noqa: ANN001, ANN202
        by_next_step.append(runner._deferred is not None and runner._deferred.deferred_sampling is not None)
        launch_deferred(runner)

    monkeypatch.setattr(model_runner.PendingStepResult, "launch_sampling", counting_launch)
    monkeypatch.setattr(model_runner.ModelRunner, "launch_deferred_sampling", counting_next_step)
    texts, preempted, launches = {}, {}, {}
    for grammar_process, async_scheduling in ((False, True), (True, True), (True, False)):
        deferred.clear()
        by_next_step.clear()
        llm = _tiny_llm(
            tiny_qwen3_real_tokenizer_path,
            kv_cache_memory_bytes=1 << 18,
            async_scheduling=async_scheduling,
            grammar_process=grammar_process,
        )
        outs = llm.generate(["Tell me about"] * 9, _mixed_batch(), use_tqdm=False)
        key = (grammar_process, async_scheduling)
        texts[key] = [[c.text for c in o.outputs] for o in outs]
        stats = llm.llm_engine.stats()
        assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
        preempted[key] = stats.num_preemptions
        launches[key] = (sum(deferred), sum(by_next_step))
        llm.llm_engine.shutdown()
    assert launches[(False, True)] == (0, 0)
    assert launches[(True, True)][1] > 0 and launches[(True, True)][0] >= launches[(True, True)][1]
    assert launches[(True, False)][0] > 0 and launches[(True, False)][1] == 0
    assert texts[(True, True)] == texts[(False, True)]
    assert texts[(True, False)] == texts[(False, True)]
    assert min(preempted.values()) > 0, preempted
    documents = [t for i in (0, 6) for t in texts[(True, True)][i]]
    assert documents and all(_valid_json(t) for t in documents)
    assert all('"age"' not in t for t in texts[(True, True)][3])  # stopped before it
    assert all(re.fullmatch(REGEX, t) for i in (1, 4, 7) for t in texts[(True, True)][i])


def test_grammar_process_drops_finished_and_aborted_grammars(llm_grammar_process):
    engine = llm_grammar_process.llm_engine
    process = engine.structured_output_manager.grammar_process
    # A step with work drops the grammars that finished since the one before (earlier tests' too).
    llm_grammar_process.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    freed = process.num_freed
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    for i in range(4):
        engine.add_request(
            f"g{i}", "Tell me about", SamplingParams(max_tokens=50, structured_outputs=constraint)
        )
    for _ in range(3):
        engine.step()
    engine.abort_request(["g0", "g1"])
    while engine.has_unfinished_requests():
        engine.step()
    llm_grammar_process.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert process.num_freed - freed == 4


def test_grammar_process_that_cannot_start_fails_only_the_constrained_requests(
    tiny_qwen3_real_tokenizer_path,
):
    from kvllm.structured_output import StructuredOutputManager
    from kvllm.structured_output.manager import GrammarProcessSettings

    llm = _tiny_llm(tiny_qwen3_real_tokenizer_path)
    engine = llm.llm_engine
    engine.structured_output_manager = StructuredOutputManager(
        engine.tokenizer,
        engine.model_config.vocab_size,
        engine.model_config.eos_token_ids,
        process=GrammarProcessSettings("/nonexistent/tokenizer", max_rows=8),
    )
    outs = llm.generate(
        ["Tell me about"] * 2,
        [
            SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex=REGEX)),
            SamplingParams(max_tokens=5, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].finish_reason == "error"
    assert "structured-outputs process could not start" in outs[0].outputs[0].stop_reason
    assert len(outs[1].outputs[0].token_ids) == 5
    engine.shutdown()


def test_a_killed_grammar_process_is_restarted_and_no_sequence_notices(
    tiny_qwen3_real_tokenizer_path, monkeypatch
):
    """The child killed three times mid-run (between steps; with a step asked for; while a restarted
    child is sent its replays): started again with every live grammar replayed, and the texts are those
    of the matchers on the engine's thread."""
    from kvllm.structured_output.grammar_process import GrammarProcess

    real_start, real_send = GrammarProcess.start_fill, GrammarProcess._send

    def start_then_kill(self, grammars):
        real_start(self, grammars)
        if self.num_steps == 8 and self.num_restarts == 1:
            self._proc.kill()  # the step just asked for is never answered

    def kill_then_send(self, message):
        if message[0] == "replay" and self._ready and self.num_restarts == 2:
            self._proc.kill()  # its first replay finds the pipe broken: the rest must not follow
            self._proc.join()
        real_send(self, message)

    monkeypatch.setattr(GrammarProcess, "start_fill", start_then_kill)
    monkeypatch.setattr(GrammarProcess, "_send", kill_then_send)
    texts = {}
    for grammar_process in (False, True):
        llm = _tiny_llm(tiny_qwen3_real_tokenizer_path, grammar_process=grammar_process)
        engine = llm.llm_engine
        process = engine.structured_output_manager.grammar_process if grammar_process else None
        for i, params in enumerate(_mixed_batch()):
            engine.add_request(str(i), "Tell me about", params)
        outs = {}
        while engine.has_unfinished_requests():
            if process is not None and process.num_steps == 4 and process.num_restarts == 0:
                process._proc.kill()  # between steps: the next message finds the pipe broken
                process._proc.join()
            for out in engine.step():
                if out.finished:
                    outs[int(out.request_id)] = [c.text for c in out.outputs]
        texts[grammar_process] = [outs[i] for i in sorted(outs)]
        engine.shutdown()
    assert process.num_restarts == 3
    assert texts[True] == texts[False]
    assert all(_valid_json(t) for i in (0, 6) for t in texts[True][i])


def test_a_grammar_process_that_keeps_dying_is_a_clear_error(tiny_qwen3_real_tokenizer_path, monkeypatch):
    from kvllm.structured_output import grammar_process
    from kvllm.structured_output.grammar_process import GrammarProcessError

    monkeypatch.setattr(grammar_process, "MAX_RESTARTS", 0)
    llm = _tiny_llm(tiny_qwen3_real_tokenizer_path, grammar_process=True)
    engine = llm.llm_engine
    constraint = StructuredOutputsParams(regex=REGEX)
    engine.add_request("g", "Tell me about", SamplingParams(max_tokens=30, structured_outputs=constraint))
    process = engine.structured_output_manager.grammar_process
    while process.num_steps < 2:
        engine.step()
    process._proc.kill()
    with pytest.raises(
        GrammarProcessError, match=r"exited \(exit code -9\), after 0 restarts without a step"
    ):
        while engine.has_unfinished_requests():
            engine.step()
    engine.shutdown()
