"""InputBatch: flat token ids, positions, slot mapping, metadata and sampling rows of each step,
built from per-request rows that persist across steps."""

import numpy as np
import pytest
import torch

from kvllm.core.request import Request
from kvllm.core.sched_output import ScheduledRequest, SchedulerOutput
from kvllm.sampling_params import SamplingParams
from kvllm.worker.input_batch import InputBatch

BLOCK = 4
VOCAB = 1000


def request(rid: str, tokens: list[int], computed: int, params: SamplingParams | None = None) -> Request:
    r = Request(rid, tokens, params or SamplingParams(), max_tokens=8, eos_token_ids=(0,))
    r.num_computed_tokens = computed
    return r


def sched(r: Request, num_new_tokens: int, block_ids: list[int]) -> ScheduledRequest:
    """What the scheduler hands over: the chunk already counted as computed (see Scheduler.schedule)."""
    r.num_computed_tokens += num_new_tokens
    return ScheduledRequest(r, num_new_tokens, block_ids)


def batch(max_reqs: int = 8, max_tokens: int = 64, max_len: int = 48) -> InputBatch:
    return InputBatch(max_reqs, max_tokens, max_len, BLOCK, VOCAB, torch.device("cpu"))


def test_mixed_step_layout():
    decode = request("d", [11, 12, 13, 14, 15, 16], computed=5)  # one new token at position 5
    chunk = request("c", list(range(100, 110)), computed=4)  # positions 4..7 of a 10-token prompt
    last = request("l", [21, 22, 23], computed=0)  # whole prompt, samples this step
    step = SchedulerOutput(
        [
            sched(decode, 1, [7, 2]),
            sched(chunk, 4, [5, 0, 9]),
            sched(last, 3, [3]),
        ]
    )
    inputs = batch().prepare(step)
    assert inputs.input_ids.tolist() == [16, 104, 105, 106, 107, 21, 22, 23]
    assert inputs.positions.tolist() == [5, 4, 5, 6, 7, 0, 1, 2]
    # slot = block_table[position // BLOCK] * BLOCK + position % BLOCK
    assert inputs.attn_metadata.slot_mapping.tolist() == [2 * 4 + 1, 0, 1, 2, 3, 12, 13, 14]
    md = inputs.attn_metadata
    assert md.num_decodes == 1 and md.num_reqs == 3 and md.num_actual_tokens == 8
    assert md.query_start_loc_cpu.tolist() == [0, 1, 5, 8]
    assert md.seq_lens_cpu.tolist() == [6, 8, 3]
    assert md.max_query_len == 4 and md.max_seq_len == 8
    assert md.block_table.tolist() == [[7, 2, 0], [5, 0, 9], [3, 0, 0]]
    # The middle request's chunk stops short of its prompt's end: it samples nothing this step.
    assert inputs.sampling_request_indices == [0, 2]
    assert inputs.logits_indices.tolist() == [0, 7]


def test_rows_persist_and_grow_across_steps():
    """A prefill then decodes: sampled tokens and new blocks are appended, nothing is re-sent, and
    a decode's input id is read from the device token table (the host need not know it)."""
    b = batch()
    r = request("a", [5, 6, 7], computed=0)
    blocks = [4]  # the KV-cache manager's own list: later steps append to it in place
    b.prepare(SchedulerOutput([sched(r, 3, blocks)]))
    b.record_sampled_on_device(torch.tensor([42]))
    r.append_output_token(42)
    inputs = b.prepare(SchedulerOutput([sched(r, 1, blocks)]))
    assert inputs.input_ids.tolist() == [42] and inputs.positions.tolist() == [3]
    assert inputs.attn_metadata.slot_mapping.tolist() == [4 * BLOCK + 3]
    b.record_sampled_on_device(torch.tensor([43]))
    blocks.append(9)  # the request crossed into a second block
    inputs = b.prepare(SchedulerOutput([sched(r, 1, blocks)]))
    assert inputs.input_ids.tolist() == [43] and inputs.positions.tolist() == [4]
    assert inputs.attn_metadata.slot_mapping.tolist() == [9 * BLOCK + 0]
    assert inputs.attn_metadata.block_table.tolist() == [[4, 9]]
    assert inputs.logits_indices is None  # every token samples: hidden[:N] is used as it is
    row = b.states["a"].row
    assert b.token_ids[row, :5].tolist() == [5, 6, 7, 42, 43]


def test_finished_and_preempted_requests_free_their_rows():
    b = batch(max_reqs=2)
    x, y = request("x", [1, 2], 0), request("y", [3], 0)
    b.prepare(SchedulerOutput([sched(x, 2, [1]), sched(y, 1, [2])]))
    b.record_sampled_on_device(torch.tensor([7, 8]))
    assert b.num_rows == 2 and not b.free_rows
    z = request("z", [9, 9, 9], 0)
    inputs = b.prepare(SchedulerOutput([sched(z, 3, [5])], preempted=[y], finished_req_ids={"x"}))
    assert set(b.states) == {"z"} and inputs.input_ids.tolist() == [9, 9, 9]
    assert inputs.attn_metadata.block_table.tolist() == [[5]]
    # A preempted request comes back as new: its whole token list (prompt and outputs) again.
    b.record_sampled_on_device(torch.tensor([4]))
    y.append_output_token(8)
    y.num_computed_tokens = 0  # preempted: recomputed from the start
    inputs = b.prepare(SchedulerOutput([sched(y, 2, [6])], finished_req_ids={"z"}))
    assert inputs.input_ids.tolist() == [3, 8] and inputs.positions.tolist() == [0, 1]
    with pytest.raises(RuntimeError, match="full"):
        b.prepare(SchedulerOutput([sched(request(f"n{i}", [1], 0), 1, [0]) for i in range(2)]))


def test_padding_for_a_cuda_graph_batch():
    b = batch()
    reqs = [request(f"r{i}", [10 + i, 20 + i], computed=1) for i in range(3)]
    inputs = b.prepare(SchedulerOutput([sched(r, 1, [i]) for i, r in enumerate(reqs)]), pad_to=8)
    md = inputs.attn_metadata
    assert md.num_reqs == 8 and md.num_actual_tokens == 8 and md.num_decodes == 8 and inputs.num_tokens == 3
    assert md.query_start_loc_cpu.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]  # padded requests: no tokens
    assert md.seq_lens_cpu.tolist() == [2, 2, 2, 0, 0, 0, 0, 0]
    assert md.slot_mapping.tolist()[3:] == [-1] * 5
    assert inputs.input_ids[:3].tolist() == [20, 21, 22]
    assert inputs.sampling_request_indices == [0, 1, 2]
    with pytest.raises(ValueError, match="uniform decode"):
        b.prepare(SchedulerOutput([sched(request("p", [1, 2, 3], 0), 3, [3])]), pad_to=8)


def test_sampling_metadata_comes_from_host_flags():
    b = batch()
    greedy = request("g", [1, 2], 0, SamplingParams(temperature=0.0))
    hot = request("h", [1, 2], 0, SamplingParams(temperature=0.5, top_k=7, top_p=0.9, logprobs=2))
    plain = request("p", [1, 2], 0, SamplingParams(min_tokens=2, repetition_penalty=1.2))
    inputs = b.prepare(SchedulerOutput([sched(r, 2, [i]) for i, r in enumerate([greedy, hot, plain])]))
    md = inputs.sampling_metadata
    assert not md.all_greedy and not md.all_random and md.is_greedy.tolist() == [True, False, False]
    assert md.temperature.tolist() == [1.0, 0.5, 1.0]
    assert md.top_k.tolist() == [VOCAB, 7, VOCAB] and md.max_top_k == 7 and not md.all_top_k
    assert md.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0]) and md.min_p is None
    assert md.num_logprobs == [None, 2, None] and md.need_sampled_logprobs
    assert md.suppressed == [(2, [0])]  # min_tokens: EOS suppressed for the third row
    assert md.penalties is not None and md.penalties.rows.tolist() == [2]
    prompt_counts, output_counts = md.penalties.token_counts(VOCAB)
    assert prompt_counts[0, 1] == 1 and prompt_counts[0, 2] == 1 and output_counts.sum() == 0


def test_token_counts_split_prompt_and_output():
    b = batch()
    r = request("a", [3, 3, 5], 0, SamplingParams(frequency_penalty=0.5))
    b.prepare(SchedulerOutput([sched(r, 3, [0])]))
    b.record_sampled_on_device(torch.tensor([5]))
    r.append_output_token(5)
    inputs = b.prepare(SchedulerOutput([sched(r, 1, [0])]))
    prompt_counts, output_counts = inputs.sampling_metadata.penalties.token_counts(VOCAB)
    expected_prompt = np.zeros(VOCAB)
    expected_prompt[[3, 5]] = [2, 1]
    assert prompt_counts[0].tolist() == expected_prompt.tolist()
    assert output_counts[0, 5] == 1 and output_counts.sum() == 1


def test_staging_sections_start_on_16_byte_boundaries():
    """Kernels are specialized on pointer alignment: an odd offset would compile other variants in
    eager steps than in CUDA-graph captures (and read with narrower loads)."""
    b = batch(max_reqs=7, max_tokens=37)
    for layout, element in ((b._i32_layout, 4), (b._i64_layout, 8)):
        starts = [start for start, _ in layout.offsets.values()]
        assert all(start * element % 16 == 0 for start in starts), layout.offsets
        ends = [start + size for start, size in layout.offsets.values()]
        assert all(end <= nxt for end, nxt in zip(ends, starts[1:])) and ends[-1] <= layout.size
