"""prepare_inputs: flat token ids, positions, slot mapping, metadata and sampling rows of one step."""

import torch

from kvllm.core.request import Request
from kvllm.core.sched_output import ScheduledRequest, SchedulerOutput
from kvllm.sampling_params import SamplingParams
from kvllm.worker.input_batch import prepare_inputs

BLOCK = 4


def request(rid: str, tokens: list[int], computed: int) -> Request:
    r = Request(rid, tokens, SamplingParams(), max_tokens=8, eos_token_ids=(0,))
    r.num_computed_tokens = computed
    return r


def test_mixed_step_layout():
    decode = request("d", [11, 12, 13, 14, 15, 16], computed=5)  # one new token at position 5
    chunk = request("c", list(range(100, 110)), computed=4)  # positions 4..7 of a 10-token prompt
    last = request("l", [21, 22, 23], computed=0)  # whole prompt, samples this step
    step = SchedulerOutput(
        [
            ScheduledRequest(decode, 1, [7, 2]),
            ScheduledRequest(chunk, 4, [5, 0, 9]),
            ScheduledRequest(last, 3, [3]),
        ]
    )
    inputs = prepare_inputs(step, BLOCK, torch.device("cpu"))
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
