"""Structured outputs, piece by piece: the bitmask against a per-bit reference, the sampler hook, the
parameter checks and the mapping of OpenAI's response_format."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.entrypoints.openai.structured_outputs import structured_outputs_params
from kvllm.sample.metadata import SamplingMetadata
from kvllm.sample.sampler import Sampler
from kvllm.sample.structured import GrammarBitmaskInputs, apply_grammar_bitmask, unpack_bitmask
from kvllm.sampling_params import SamplingParams, StructuredOutputsParams
from kvllm.structured_output import StructuredOutputManager
from kvllm.structured_output.backend_xgrammar import StructuredOutputError, choice_grammar, validate
from tests.model_factory import EOS_ID, write_tokenizer


def _reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    words = bitmask.tolist()
    out = torch.zeros(len(words), vocab, dtype=torch.bool)
    for r, row in enumerate(words):
        for t in range(vocab):
            w = t // 32
            out[r, t] = w < len(row) and (row[w] >> (t % 32)) & 1 == 1
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 200, 230])
def test_unpack_bitmask_matches_bit_by_bit_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (5, (min(vocab, 200) + 31) // 32), dtype=torch.int32, generator=g
    )
    # vocab 230 > 7 words * 32 = 224: the tokens past the mask are banned.
    assert torch.equal(unpack_bitmask(bitmask, vocab), _reference_allowed(bitmask, vocab))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_grammar_bitmask_bans_exactly_the_cleared_bits(dtype):
    g = torch.Generator().manual_seed(0)
    vocab = 100
    logits = torch.randn(4, vocab, generator=g).to(dtype)
    before = logits.clone()
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 4), dtype=torch.int32, generator=g)
    bitmask[2] = -1  # an unconstrained row keeps every bit
    out = apply_grammar_bitmask(logits, GrammarBitmaskInputs(bitmask))
    allowed = _reference_allowed(bitmask, vocab)
    assert out.dtype == torch.float32
    assert torch.equal(out[allowed], logits.float()[allowed])
    assert bool((out[~allowed] == float("-inf")).all())
    assert torch.equal(out[2], logits[2].float())
    assert torch.equal(logits, before)  # the model's logits are not written


@pytest.mark.parametrize("fused", [False, True])  # True: the GPU's one-pass Triton sampler, interpreted
def test_sampler_only_draws_allowed_tokens_and_reports_constrained_logprobs(fused):
    g = torch.Generator().manual_seed(1)
    rows, vocab = 64, 96
    logits = torch.randn(rows, vocab, generator=g) * 3
    allowed = torch.rand(rows, vocab, generator=g) < 0.05
    allowed[:, 7] = True  # at least one token per row
    bits = torch.zeros(rows, vocab // 32, dtype=torch.int64)
    for t in range(vocab):
        bits[:, t // 32] |= allowed[:, t].long() << (t % 32)
    bitmask = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    params = [SamplingParams(temperature=1.0, logprobs=0)] * rows
    md = SamplingMetadata.from_params(params, logits.device, vocab)
    md.grammar = GrammarBitmaskInputs(bitmask)
    for _ in range(5):
        sampled = Sampler(fused=fused).sample(logits, md).to_host()
        assert all(allowed[r, t] for r, t in enumerate(sampled.token_ids))
    expected = logits.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    got = torch.tensor(sampled.sampled_logprobs)
    want = expected[torch.arange(rows), torch.tensor(sampled.token_ids)]
    torch.testing.assert_close(got, want)


def test_structured_outputs_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="no constraint"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams(json={}, whitespace_pattern=r"\s*")
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    assert StructuredOutputsParams(choice=("a", "b")).kind == "choice"


def test_choice_grammar_escapes_quotes_and_backslashes():
    validate(StructuredOutputsParams(grammar=choice_grammar(['say "hi"', "back\\slash", "new\nline"])))


def test_validation_errors_name_the_problem_without_xgrammar_locations():
    with pytest.raises(StructuredOutputError) as info:
        validate(StructuredOutputsParams(regex="(unclosed"))
    assert str(info.value).startswith("structured_outputs.regex is not valid: ")
    assert ".cc:" not in str(info.value)
    with pytest.raises(StructuredOutputError, match="structural_tag"):
        validate(StructuredOutputsParams(structural_tag="{}"))


STRUCTURAL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# vLLM's two forms of a structural tag: xgrammar's StructuralTag, and the legacy structures + triggers.
TAG_FORMAT = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<call>"],
        "tags": [{"begin": "<call>", "content": {"type": "json_schema", "json_schema": STRUCTURAL_SCHEMA},
                  "end": "</call>"}],
    },
}  # fmt: skip
TAG_LEGACY = {
    "type": "structural_tag",
    "structures": [{"begin": "<call>", "schema": STRUCTURAL_SCHEMA, "end": "</call>"}],
    "triggers": ["<call>"],
}


@pytest.mark.parametrize("tag", [TAG_FORMAT, TAG_LEGACY], ids=["format", "legacy"])
def test_structural_tags_validate_and_constrain_after_their_trigger(tag, tmp_path):
    """Either form: free text until the trigger, then the schema's JSON and the end tag."""
    import json

    from transformers import PreTrainedTokenizerFast

    params = StructuredOutputsParams(structural_tag=json.dumps(tag))
    validate(params)
    write_tokenizer(tmp_path, 400)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    manager = StructuredOutputManager(tokenizer, len(tokenizer), [EOS_ID])
    backend = manager.backend

    def accepts(text: str) -> bool:
        matcher = backend.matcher(backend.compile(params))
        return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert accepts('any words first <call>{"a": 12}</call> and after')
    assert not accepts('words <call>{"a": "twelve"}</call>')  # the schema holds inside the tag
    assert not accepts('words <call>{"a": 1}</other>')  # and the end tag closes it
    manager.shutdown()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "structural_tag is not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        (
            '{"structures": [{"begin": "<a>", "schema": {}}], "triggers": ["<a>"]}',
            r"structures\[0\] lacks end",
        ),
        ('{"structures": [], "triggers": []}', "triggers must be a non-empty list of strings"),
        ('{"structures": "x", "triggers": ["<a>"]}', "structures must be a list of objects"),
        ('{"type": "structural_tag", "format": {"type": "bogus"}}', "Format type not recognized: bogus"),
    ],
)
def test_bad_structural_tags_are_refused_with_the_reason(text, message):
    with pytest.raises(StructuredOutputError, match=message):
        validate(StructuredOutputsParams(structural_tag=text))


def test_structural_tags_naming_tokens_wait_for_the_tokenizer_to_be_checked():
    """A token named by its text resolves only with a tokenizer: the tokenizer-free check lets it by."""
    import json

    tag = {"type": "structural_tag", "format": {"type": "token", "token": "<|im_end|>"}}
    validate(StructuredOutputsParams(structural_tag=json.dumps(tag)))


def test_response_format_maps_as_vllm_does():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert structured_outputs_params(None, None) is None
    assert structured_outputs_params(None, {"type": "text"}) is None
    got = structured_outputs_params(
        None, {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert got == StructuredOutputsParams(json=schema)
    assert structured_outputs_params(None, {"type": "json_object"}) == StructuredOutputsParams(
        json_object=True
    )
    assert structured_outputs_params({"regex": "[a-z]+"}, None) == StructuredOutputsParams(regex="[a-z]+")
    # response_format replaces the body's constraint and keeps its options
    both = structured_outputs_params({"regex": "a", "disable_any_whitespace": True}, {"type": "json_object"})
    assert both == StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    for tag in (TAG_FORMAT, TAG_LEGACY):  # the whole response_format as JSON, as vLLM passes it on
        got = structured_outputs_params(None, tag)
        assert got is not None and json.loads(got.structural_tag) == tag


@pytest.mark.parametrize(
    ("body", "response_format", "param", "message"),
    [
        (
            None,
            {"type": "xml"},
            "response_format",
            "not valid; allowed: text, json_object, json_schema, structural_tag",
        ),
        (None, {"type": "structural_tag"}, "response_format", "needs 'format'"),
        (
            None,
            {"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a>"]},
            "response_format",
            "lacks schema, end",
        ),
        (None, {"type": "json_schema"}, "response_format", "'json_schema' field must be provided"),
        (
            None,
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
            "response_format",
            "bogus",
        ),
        ({"regex": "[", "choice": ["a"]}, None, "structured_outputs", "only one kind"),
        ({"jsn": {}}, None, "structured_outputs", "unknown field"),
        ({"grammar": "root ::= x"}, None, "structured_outputs", "x"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(body, response_format, param, message):
    with pytest.raises(OpenAIError) as info:
        structured_outputs_params(body, response_format)
    assert info.value.status == 400 and info.value.param == param
    assert message in info.value.message


def test_grammar_bitmask_reuses_two_buffers_and_fills_on_the_calling_thread(tmp_path):
    """Issue 19: the per-step mask was a fresh [rows, vocab / 32] tensor (pinned on CUDA) and a
    multi-threaded fill. Counted: two buffers for any number of steps (one more only when the batch
    grows), no fill through xgrammar's thread pool below THREADED_FILL_MIN_ROWS rows, and every
    mask exactly the matcher's own (unconstrained rows all ones, whatever the buffer held before)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    vocab = write_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    manager = StructuredOutputManager(tokenizer, vocab + 7, (EOS_ID,))
    manager._filler.fill_threads = 4  # as on a many-core host: small batches must still stay on this thread
    params = StructuredOutputsParams(regex="(ab|ba)+c")
    grammars = [manager.make_request(params) for _ in range(6)]
    for g in grammars:
        while not g.is_ready():
            g.wait(1.0)
    pointers = set()
    for step in range(6):
        # A different subset constrained each step, so stale bits of a reused buffer would show.
        live = [g if (i + step) % 3 else None for i, g in enumerate(grammars)]
        mask = manager.grammar_bitmask(live)
        assert mask is not None and mask.shape == tuple(xgr.get_bitmask_shape(6, vocab + 7))
        pointers.add(mask.data_ptr())
        for row, g in enumerate(live):
            expected = torch.full((1, mask.shape[1]), -1, dtype=torch.int32)
            if g is not None:
                g.matcher.fill_next_token_bitmask(expected, 0)
            assert torch.equal(mask[row], expected[0]), (step, row)
        for g in live:
            if g is not None:  # advance by the first allowed token
                allowed = unpack_bitmask(mask[live.index(g)].unsqueeze(0).contiguous(), vocab)[0]
                g.accept_token(int(allowed.nonzero()[0]))
    assert manager.num_buffer_allocations == 2 and len(pointers) == 2
    assert manager.num_threaded_fills == 0
    manager.grammar_bitmask(grammars + grammars[:2])  # a larger batch: that buffer grows, once
    assert manager.num_buffer_allocations == 3
    manager.shutdown()


def test_large_batches_fill_through_xgrammars_thread_pool_with_the_same_masks(tmp_path):
    """From THREADED_FILL_MIN_ROWS constrained rows the masks come from xgrammar's thread pool, and
    they are bit for bit each matcher's own (grammars at different points, unconstrained rows all ones)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from kvllm.structured_output.backend_xgrammar import THREADED_FILL_MIN_ROWS

    vocab = write_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    manager = StructuredOutputManager(tokenizer, vocab + 7, (EOS_ID,))
    manager._filler.fill_threads = 2
    rows = THREADED_FILL_MIN_ROWS * 7 // 6 + 8  # every seventh row unconstrained: still over the threshold
    grammars = [manager.make_request(StructuredOutputsParams(regex="(ab|ba)+c")) for _ in range(rows)]
    for g in grammars:
        while not g.is_ready():
            g.wait(1.0)
    rng = random.Random(0)
    for g in grammars:  # each grammar a random number of tokens into its language
        for _ in range(rng.randrange(4)):
            allowed = xgr.allocate_token_bitmask(1, vocab + 7)
            g.matcher.fill_next_token_bitmask(allowed, 0)
            g.accept_token(int(rng.choice(unpack_bitmask(allowed, vocab)[0].nonzero().flatten().tolist())))
    live = [None if i % 7 == 0 else g for i, g in enumerate(grammars)]
    threaded_before = manager.num_threaded_fills
    mask = manager.grammar_bitmask(live)
    assert manager.num_threaded_fills == threaded_before + 1
    for row, g in enumerate(live):
        expected = torch.full((1, mask.shape[1]), -1, dtype=torch.int32)
        if g is not None:
            g.matcher.fill_next_token_bitmask(expected, 0)
        assert torch.equal(mask[row], expected[0]), row
    manager.shutdown()


def test_grammar_process_masks_equal_the_engine_threads_step_by_step(tmp_path):
    """The same sequences on both managers (matchers here, matchers in the grammar process): every
    step's mask is bit-for-bit the same, rows of finished (None), terminated and rejected grammars
    included; freed grammars are forgotten, and the process stops with the manager."""
    from transformers import AutoTokenizer

    from kvllm.structured_output.manager import GrammarProcessSettings

    vocab = write_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    here = StructuredOutputManager(tokenizer, vocab + 7, (EOS_ID,))
    there = StructuredOutputManager(
        tokenizer, vocab + 7, (EOS_ID,), process=GrammarProcessSettings(str(tmp_path), max_rows=8)
    )
    constraints = [StructuredOutputsParams(regex="(ab|ba)+c"), StructuredOutputsParams(choice=["abc", "cab"])]
    pairs = [(here.make_request(p), there.make_request(p)) for p in constraints for _ in range(3)]
    for pair in pairs:
        for g in pair:
            while not g.is_ready():
                g.wait(1.0)
    assert all(g.error is None for pair in pairs for g in pair)
    generator = torch.Generator().manual_seed(0)
    rejected_row, calls = 5, 0
    for step in range(8):
        live = [pair if (i + step) % 4 else (None, None) for i, pair in enumerate(pairs)]
        masks = [m.grammar_bitmask([pair[k] for pair in live]) for k, m in enumerate((here, there))]
        calls += 1
        if masks[0] is None:
            assert masks[1] is None
            break
        assert torch.equal(masks[0], masks[1]), step
        allowed = unpack_bitmask(masks[0].contiguous(), vocab)
        for row, (g_here, g_there) in enumerate(live):
            if g_here is None:
                continue
            if row == rejected_row and step == 2:  # a token the mask forbids: both give the row up
                token = int((~allowed[row]).nonzero()[0])
            else:
                token = int(torch.multinomial(allowed[row].float(), 1, generator=generator))
            g_here.accept_token(token)
            g_there.accept_token(token)
    assert pairs[rejected_row][0].rejected
    there.release([g for _, g in pairs])
    process = there.grammar_process
    assert process.num_freed == len(pairs) and process.num_steps == calls
    there.shutdown()
    assert not process.is_alive()
    here.shutdown()
