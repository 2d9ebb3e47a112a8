"""The persistent input batch: the worker's per-request state, and the flat tensors of each step.

Each running request owns a row, from the step it is first scheduled until it finishes or is
preempted. A row keeps the request's token ids (on the device only), its block table and its
sampling parameters (on the host, numpy, and on the device), written when something changes: a new
request writes its prompt once, a step appends the blocks the scheduler added, and the sampled ids
are scattered into the device token table by the step that sampled them. Nothing is rebuilt per step.

A step's inputs are computed with numpy over the step's requests and tokens, written into a pinned
staging buffer per dtype at fixed offsets (two, used in turn, so the host can prepare a step while
the previous one's upload waits on the stream), and uploaded with one non-blocking copy each; the
device-side buffers are what the model, the attention builder and the CUDA graphs read (their
addresses never change). Input ids are gathered on the device from the token table, so a decode
does not need the previous step's tokens on the host. Rows are in arbitrary order; the step's order
(decodes first) is applied on the device by gathering rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvllm.attention.metadata import CommonAttentionMetadata
from kvllm.core.request import Request
from kvllm.core.sched_output import ScheduledRequest, SchedulerOutput
from kvllm.sample.metadata import (
    AllowedTokenInputs,
    BadWordInputs,
    LogitBiasInputs,
    SamplingMetadata,
    penalty_inputs,
)
from kvllm.sample.token_constraints import bad_word_table, logit_bias_arrays, logit_bias_inputs
from kvllm.sampling_params import SamplingParams
from kvllm.spec_decode.inputs import SpecInputs, output_slots, spec_layout
from kvllm.spec_decode.rejection_sampler import DraftLayout, draft_layout_host
from kvllm.worker.buffers import CpuGpuBuffer, Layout, StagingBuffer, upload_from_host
from kvllm.worker.decode_advance import DecodeStepMemory, advance_decode


@dataclass
class RequestState:
    """What the worker keeps about one request (read from the Request once, when it joins)."""

    req_id: str
    row: int
    params: SamplingParams
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...]
    bad_words: list[list[int]]  # token ids of params.bad_words
    logit_bias: tuple[np.ndarray, np.ndarray] | None  # (token ids, biases) of params.logit_bias


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # int32 [T] (padded: [B] for a CUDA-graph batch)
    positions: torch.Tensor  # int32 [T]
    attn_metadata: CommonAttentionMetadata
    logits_indices: torch.Tensor | None  # int64 [N]: the token of each sampling request; None = [0, N)
    sampling_request_indices: list[int]  # positions in `scheduled` of the N requests that sample
    sampling_metadata: SamplingMetadata | None
    num_tokens: int  # real tokens (T); the padded count is attn_metadata.num_actual_tokens
    query_starts: np.ndarray  # per scheduled request: the position of its first token this step
    prompt_logprob_indices: list[int]  # scheduled requests that asked for prompt logprobs
    spec: SpecInputs | None = None  # the drafts to verify (speculative decoding), if any
    # int64 [T] (padded as input_ids): each token's flat slot in the token table; None on the decode
    # fast path
    token_index: torch.Tensor | None = None


class InputBatch:
    """Rows of per-request state plus the staging buffers of one step, at maximum sizes."""

    decode_fast_path = True  # advance repeated graph decode steps on the device (decode_advance.py)

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.max_blocks_per_req = -(-max_model_len // block_size)

        # ---- rows ----
        self.states: dict[str, RequestState] = {}
        self.row_states: list[RequestState | None] = [None] * max_num_reqs
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out low rows first
        # Token ids live on the device only: prompts are written once, sampled ids are scattered in
        # by the step that sampled them, and each step gathers its input ids from here. So a decode
        # never needs the previous step's tokens on the host (what overlapped scheduling relies on).
        self.token_ids = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32, device=device)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + sampled (or being sampled)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)  # tokens whose K/V is cached
        self.block_table = CpuGpuBuffer((max_num_reqs, self.max_blocks_per_req), torch.int32, device)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Sampling parameters per row, as the sampler's tensors want them (host copies decide flags).
        self.temperature = CpuGpuBuffer(max_num_reqs, torch.float32, device)
        self.top_p = CpuGpuBuffer(max_num_reqs, torch.float32, device)
        self.min_p = CpuGpuBuffer(max_num_reqs, torch.float32, device)
        self.top_k = CpuGpuBuffer(max_num_reqs, torch.int64, device)
        self.is_greedy = CpuGpuBuffer(max_num_reqs, torch.bool, device)
        # Host-only flags that select the sampler's rarer paths without a per-request Python loop.
        self.has_generator = np.zeros(max_num_reqs, dtype=bool)
        self.has_penalties = np.zeros(max_num_reqs, dtype=bool)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1 = none asked
        self.wants_prompt_logprobs = np.zeros(max_num_reqs, dtype=bool)
        self.has_allowed_token_ids = np.zeros(max_num_reqs, dtype=bool)
        self.has_bad_words = np.zeros(max_num_reqs, dtype=bool)
        self.has_logit_bias = np.zeros(max_num_reqs, dtype=bool)
        # bool [max_num_reqs, V] on the device, True where a row's allowed_token_ids leave a token out;
        # allocated by the first request that has allowed_token_ids. Rows without them are never read.
        self._disallowed: torch.Tensor | None = None
        self._params_dirty = False

        # ---- one step's staging, fixed offsets (int32 and int64 sections) ----
        t, r = max_num_tokens, max_num_reqs
        self._i32_layout = Layout(4, positions=t, query_start_loc=r + 1, seq_lens=r)
        self._i64_layout = Layout(
            8, token_index=t, slots=t, rows=r, logits_indices=r, sample_slots=r, samples=r
        )
        self.step_i32 = StagingBuffer(self._i32_layout.size, torch.int32, device)
        self.step_i64 = StagingBuffer(self._i64_layout.size, torch.int64, device)
        self.input_ids = torch.zeros(t, dtype=torch.int32, device=device)  # gathered each step, fixed address
        # Block-table entries appended this step (flat index, block id), and token ids to write into
        # the token table (flat start, ids): prompts of new rows, drafts to verify.
        self._block_updates: list[tuple[np.ndarray, list[int]]] = []
        self._new_tokens: list[tuple[int, list[int]]] = []
        # The previous step, when it was a graph decode the next one may advance (decode_advance.py).
        self._last_decode: DecodeStepMemory | None = None
        self.num_advanced_steps = 0  # steps prepared by the fast path (tests and benchmarks read it)
        # The previous step's requests (the live objects, in step order) and their rows: a step of the
        # same requests (every decode step between joins and finishes) reuses the rows as they are.
        self._last_requests: list[Request] = []
        self._last_rows = np.empty(0, dtype=np.int64)
        # Speculative decoding (scheduled without overlap): how many tokens a step adds is known
        # only after verification, so each step takes its rows' counts from the requests.
        self.counts_from_requests = False
        self._num_drafts: np.ndarray | None = None
        self._drafts: list[int] = []  # this step's drafts, in step order

    # ---- row bookkeeping ------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return len(self.states)

    def update_states(self, step: SchedulerOutput) -> tuple[np.ndarray, np.ndarray]:
        """Apply the scheduler's changes: drop finished and preempted requests, add new ones, and
        append the blocks allocated this step. O(changes) plus one pass over the step's requests;
        returns the step's rows and query lengths, in step order."""
        for req_id in step.finished_req_ids:
            self.remove(req_id)
        for request in step.preempted:
            self.remove(request.request_id)
        self._num_drafts = None
        self._drafts = []
        if self.counts_from_requests:  # speculative decoding: drafts, and counts that roll back
            return self._update_spec_states(step)
        scheduled = step.scheduled
        requests = [item.request for item in scheduled]
        if requests == self._last_requests:  # identity: Request compares by identity
            rows = self._last_rows
        else:
            rows = np.array([self._row_of(request, item) for request, item in zip(requests, scheduled)])
            self._last_requests, self._last_rows = requests, rows
        num_block_ids = np.array([len(item.block_ids) for item in scheduled], dtype=np.int64)
        # Blocks are appended only where the scheduler added some (a decode: once per block_size steps).
        grew = np.flatnonzero(num_block_ids > self.num_blocks[rows])
        if grew.size:
            have = self.num_blocks[rows[grew]]
            if (num_block_ids[grew] == have + 1).all():  # one block each, the decode case: at once
                grown_rows = rows[grew]
                new = [scheduled[i].block_ids[-1] for i in grew.tolist()]
                self.block_table.np[grown_rows, have] = new
                self._block_updates.append((grown_rows * self.max_blocks_per_req + have, new))
                self.num_blocks[grown_rows] = have + 1
            else:
                for i in grew.tolist():
                    self._append_blocks(int(rows[i]), scheduled[i].block_ids)
        return rows, np.array([item.num_new_tokens for item in scheduled], dtype=np.int64)

    def _row_of(self, request: Request, item: ScheduledRequest) -> int:
        state = self.states.get(request.request_id)
        if state is None:
            state = self._add(request, item.num_new_tokens)
        return state.row

    def _update_spec_states(self, step: SchedulerOutput) -> tuple[np.ndarray, np.ndarray]:
        """update_states with speculative decoding: the counts are read from the requests (rejected
        drafts roll them back), and the drafts to verify are written to the token table."""
        num_reqs = len(step.scheduled)
        rows = np.empty(num_reqs, dtype=np.int64)
        query_lens = np.empty(num_reqs, dtype=np.int64)
        states = self.states
        for i, item in enumerate(step.scheduled):
            request = item.request
            state = states.get(request.request_id)
            if state is None:
                state = self._add(request, item.num_new_tokens)
            else:
                self.num_tokens[state.row] = request.num_tokens
                self.num_computed[state.row] = request.num_computed_tokens - item.num_new_tokens
            row = state.row
            if item.spec_token_ids:
                if self._num_drafts is None:
                    self._num_drafts = np.zeros(num_reqs, dtype=np.int64)
                self._num_drafts[i] = len(item.spec_token_ids)
                self._drafts += item.spec_token_ids
                self._new_tokens.append((row * self.max_model_len + request.num_tokens, item.spec_token_ids))
            rows[i] = row
            query_lens[i] = item.num_new_tokens
            if len(item.block_ids) > self.num_blocks[row]:
                self._append_blocks(row, item.block_ids)
        return rows, query_lens

    def _add(self, request: Request, num_new_tokens: int) -> RequestState:
        if not self.free_rows:
            raise RuntimeError(f"input batch is full ({self.max_num_reqs} rows): max_num_seqs exceeded")
        row = self.free_rows.pop()
        tokens = request.all_token_ids
        self._new_tokens.append((row * self.max_model_len, tokens))
        self.num_tokens[row] = len(tokens)
        # The scheduler has already counted this step's chunk as computed.
        self.num_computed[row] = request.num_computed_tokens - num_new_tokens
        self.num_blocks[row] = 0
        params = request.sampling_params
        greedy = params.is_greedy
        self.is_greedy.np[row] = greedy
        self.has_generator[row] = request.generator is not None and not greedy
        self.has_penalties[row] = params.has_penalties
        self.min_tokens[row] = params.min_tokens
        self.num_prompt_tokens[row] = len(request.prompt_token_ids)
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.wants_prompt_logprobs[row] = params.prompt_logprobs is not None
        self.has_allowed_token_ids[row] = params.allowed_token_ids is not None
        if params.allowed_token_ids is not None:
            self._write_allowed_token_ids(row, params.allowed_token_ids)
        bad_words = params.bad_words_token_ids or []
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError(f"request {request.request_id}: bad_words were not tokenized by the engine")
        self.has_bad_words[row] = bool(bad_words)
        self.has_logit_bias[row] = bool(params.logit_bias)
        self.temperature.np[row] = 1.0 if greedy else params.temperature
        self.top_p.np[row] = 1.0 if greedy else params.top_p
        self.min_p.np[row] = 0.0 if greedy else params.min_p
        self.top_k.np[row] = (
            params.top_k if (not greedy and 0 < params.top_k < self.vocab_size) else self.vocab_size
        )
        self._params_dirty = True
        state = RequestState(
            req_id=request.request_id,
            row=row,
            params=params,
            generator=request.generator,
            eos_token_ids=tuple(request.eos_token_ids),
            bad_words=bad_words,
            logit_bias=logit_bias_arrays(params.logit_bias) if params.logit_bias else None,
        )
        self.states[request.request_id] = state
        self.row_states[row] = state
        return state

    def _write_allowed_token_ids(self, row: int, token_ids: list[int]) -> None:
        """The row's disallowed mask: every token but `token_ids` (in the vocabulary: checked upstream)."""
        if self._disallowed is None:
            self._disallowed = torch.zeros(
                (self.max_num_reqs, self.vocab_size), dtype=torch.bool, device=self.device
            )
        ids = torch.tensor(token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        self._disallowed[row].fill_(True).index_fill_(0, ids, False)

    def remove(self, req_id: str) -> None:
        """Free a request's row (unknown ids are ignored: it may never have been scheduled)."""
        state = self.states.pop(req_id, None)
        if state is None:
            return
        self._last_decode = None
        self._last_requests = []
        row = state.row
        self.row_states[row] = None
        self.block_table.np[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.free_rows.append(row)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        have = int(self.num_blocks[row])
        new = block_ids[have:]
        count = len(new)
        self.block_table.np[row, have : have + count] = new
        self._block_updates.append((np.arange(have, have + count) + row * self.max_blocks_per_req, new))
        self.num_blocks[row] = have + count

    def _sync_rows_to_device(self) -> None:
        """Upload what changed in the rows since the last step (prompts, blocks, parameters)."""
        if self._new_tokens:
            index = np.concatenate([np.arange(start, start + len(t)) for start, t in self._new_tokens])
            values = torch.tensor([x for _, t in self._new_tokens for x in t], dtype=torch.int32)
            self.token_ids.view(-1).index_copy_(
                0,
                upload_from_host(torch.from_numpy(index), self.device),
                upload_from_host(values, self.device),
            )
            self._new_tokens.clear()
        if self._block_updates:
            if self.device.type != "cpu":
                index = np.concatenate([i for i, _ in self._block_updates])
                values = torch.tensor([b for _, ids in self._block_updates for b in ids], dtype=torch.int32)
                self.block_table.gpu.view(-1).index_copy_(
                    0,
                    upload_from_host(torch.from_numpy(index), self.device),
                    upload_from_host(values, self.device),
                )
            self._block_updates.clear()
        if self._params_dirty:
            for buffer in (self.temperature, self.top_p, self.min_p, self.top_k, self.is_greedy):
                buffer.upload()
            self._params_dirty = False

    # ---- one step -------------------------------------------------------------------------------

    def prepare(self, step: SchedulerOutput, pad_to: int | None = None, query_len: int = 1) -> ModelInputs:
        """The step's flat inputs (requests already ordered decodes first by the scheduler).

        With `pad_to` (a CUDA-graph size >= the number of requests, each with at most `query_len`
        tokens: 1, or k + 1 for a speculative verification) the metadata covers `pad_to` requests
        and `pad_to * query_len` tokens, the extra ones padding (query length 0, sequence length 0,
        slot -1); the real tokens stay packed at the front.
        """
        rows, query_lens = self.update_states(step)
        advanced = self._advance(rows, query_lens, pad_to if query_len == 1 else None)
        if advanced is not None:
            return advanced
        self._last_decode = None
        self._sync_rows_to_device()
        num_reqs = len(rows)
        starts = self.num_computed[rows]
        seq_lens = starts + query_lens
        num_tokens = int(query_lens.sum())
        max_query_len = int(query_lens.max())
        is_uniform_decode = max_query_len == 1
        if pad_to is not None and (max_query_len > query_len or pad_to < num_reqs):
            raise ValueError(
                f"pad_to={pad_to} needs a uniform decode batch of at most {pad_to} requests of at most "
                f"{query_len} tokens (got {num_reqs} requests, up to {max_query_len} tokens)"
            )
        padded = pad_to if pad_to is not None else num_reqs
        padded_tokens = padded * query_len if pad_to is not None else num_tokens
        multi_token_graph = pad_to is not None and query_len > 1

        i32 = self._i32_layout.views(self.step_i32.next_host_numpy())
        i64 = self._i64_layout.views(self.step_i64.next_host_numpy())
        cu = i32["query_start_loc"]
        cu[0] = 0
        np.cumsum(query_lens, out=cu[1 : num_reqs + 1])
        if is_uniform_decode:
            positions = starts
            token_rows = rows
        else:
            req_of_token = np.repeat(np.arange(num_reqs), query_lens)
            token_rows = rows[req_of_token]
            positions = starts[req_of_token] + (np.arange(num_tokens) - cu[:num_reqs][req_of_token])
        i64["token_index"][:num_tokens] = token_rows * self.max_model_len + positions
        i32["positions"][:num_tokens] = positions
        slots = i64["slots"]
        slots[:num_tokens] = self.block_table.np[token_rows, positions // self.block_size]
        slots[:num_tokens] *= self.block_size
        slots[:num_tokens] += positions % self.block_size
        i32["seq_lens"][:num_reqs] = seq_lens
        i64["rows"][:num_reqs] = rows
        if padded > num_reqs:
            cu[num_reqs + 1 : padded + 1] = num_tokens
            i32["seq_lens"][num_reqs:padded] = 0
            i64["rows"][num_reqs:padded] = rows[0]
        if padded_tokens > num_tokens:
            slots[num_tokens:padded_tokens] = -1
            i64["token_index"][num_tokens:padded_tokens] = 0
            i32["positions"][num_tokens:padded_tokens] = 0

        # Only requests whose chunk reaches their last known token produce a next token.
        num_drafts = self._num_drafts
        samples_mask = (seq_lens if num_drafts is None else seq_lens - num_drafts) == self.num_tokens[rows]
        samples = np.flatnonzero(samples_mask)
        num_samples = len(samples)
        all_sample = num_samples == num_reqs and num_tokens == num_reqs
        if not all_sample:
            i64["logits_indices"][:num_samples] = cu[1:][samples] - 1
        sample_rows = rows[samples]
        i64["samples"][:num_samples] = samples
        # Where each sampled token will sit in the device token table.
        i64["sample_slots"][:num_samples] = sample_rows * self.max_model_len + self.num_tokens[sample_rows]

        dev32 = self._i32_layout.views(self.step_i32.upload())
        dev64 = self._i64_layout.views(self.step_i64.upload())
        num_inputs = max(num_tokens, padded_tokens)
        torch.index_select(
            self.token_ids.view(-1), 0, dev64["token_index"][:num_inputs], out=self.input_ids[:num_inputs]
        )
        max_cols = int(self.num_blocks[rows].max())
        block_table = self.block_table.gpu[dev64["rows"][:padded], :max_cols]
        cpu32 = self._i32_layout.views(self.step_i32.host)
        num_decodes = padded if is_uniform_decode or multi_token_graph else _leading_ones(query_lens)
        metadata = CommonAttentionMetadata(
            num_reqs=padded,
            num_actual_tokens=num_inputs,
            num_decodes=num_decodes,
            num_decode_tokens=num_inputs if multi_token_graph else num_decodes,
            query_start_loc=dev32["query_start_loc"][: padded + 1],
            query_start_loc_cpu=cpu32["query_start_loc"][: padded + 1],
            seq_lens=dev32["seq_lens"][:padded],
            seq_lens_cpu=cpu32["seq_lens"][:padded],
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            block_table=block_table,
            slot_mapping=dev64["slots"][:num_inputs],
            decode_query_len=query_len if multi_token_graph else 1,
        )
        self._pending = _PendingStep(sample_rows, dev64["sample_slots"][:num_samples])
        sampling_metadata = None
        if num_samples:
            index = dev64["rows"][:num_reqs] if all_sample else dev64["rows"][dev64["samples"][:num_samples]]
            sampling_metadata = self._sampling_metadata(sample_rows, index)
        spec = None
        if num_drafts is not None:
            spec = self._spec_inputs(rows, num_drafts, cu[: num_reqs + 1].astype(np.int64), samples)
        # The step is launched: its tokens count as computed and its samples as known tokens (their
        # ids reach the device token table before the next step reads them; the host never needs them).
        self.num_computed[rows] += query_lens
        self.num_tokens[sample_rows] += 1
        sampling_request_indices = samples.tolist()
        if pad_to is not None and all_sample and query_len == 1:
            self._last_decode = DecodeStepMemory(
                rows=rows,
                pad_to=pad_to,
                seq_lens=i32["seq_lens"][:padded].copy(),
                query_start_loc=torch.from_numpy(cu[: padded + 1].copy()),
                sampling_metadata=sampling_metadata if self._sampling_is_static(sample_rows) else None,
                sampling_request_indices=sampling_request_indices,
            )
        return ModelInputs(
            input_ids=self.input_ids[:num_inputs],
            positions=dev32["positions"][:num_inputs],
            attn_metadata=metadata,
            logits_indices=None if all_sample else dev64["logits_indices"][:num_samples],
            sampling_request_indices=list(sampling_request_indices),
            sampling_metadata=sampling_metadata,
            num_tokens=num_tokens,
            query_starts=starts,
            prompt_logprob_indices=np.flatnonzero(self.wants_prompt_logprobs[rows]).tolist(),
            spec=spec,
            token_index=dev64["token_index"][:num_inputs],  # padded rows (graph batches): index 0
        )

    def _spec_inputs(
        self, rows: np.ndarray, num_drafts: np.ndarray, cu: np.ndarray, samples: np.ndarray
    ) -> SpecInputs:
        """The verification inputs of the requests with drafts (before their counts advance)."""
        spec, sample_pos, hidden_rows = spec_layout(num_drafts, cu, samples)
        ks = num_drafts[spec]
        spec_rows = rows[spec]
        draft_rows = np.repeat(spec_rows, ks)
        slots, out_index = output_slots(spec_rows, self.num_tokens[spec_rows], ks, self.max_model_len)
        counts, draft_index = draft_layout_host(ks)
        # One upload for all of them (int64, in this order), sliced on the device.
        parts = [
            sample_pos,
            cu[spec],
            hidden_rows,
            np.asarray(self._drafts, dtype=np.int64),
            draft_rows,
            slots,
            out_index,
            counts,
            draft_index,
        ]
        packed = self._upload(np.concatenate([np.asarray(a, dtype=np.int64) for a in parts]))
        views = packed.split([len(a) for a in parts])
        return SpecInputs(
            scheduled_indices=spec.tolist(),
            num_drafts=ks.tolist(),
            sample_positions=views[0],
            query_starts=views[1],
            logits_indices=views[2],
            draft_token_ids=views[3],
            sampling_metadata=self._sampling_metadata(draft_rows, views[4]),
            table_slots=views[5],
            output_index=views[6],
            layout=DraftLayout(views[7], views[8]),
            sample_positions_host=sample_pos,
        )

    def _advance(self, rows: np.ndarray, query_lens: np.ndarray, pad_to: int | None) -> ModelInputs | None:
        """The step's inputs by the decode fast path (decode_advance.py), or None when it does not
        apply: not a graph decode of the previous step's rows, or something to upload first."""
        last = self._last_decode
        if (
            last is None
            or not self.decode_fast_path
            or pad_to != last.pad_to
            or self._new_tokens
            or self._params_dirty
            or len(rows) != len(last.rows)
            or not np.array_equal(rows, last.rows)
            or (query_lens != 1).any()
        ):
            return None
        self._sync_rows_to_device()  # block ids appended this step, before the kernel reads them
        num_reqs = len(rows)
        dev32 = self._i32_layout.views(self.step_i32.gpu)
        dev64 = self._i64_layout.views(self.step_i64.gpu)
        dev_rows = dev64["rows"][:num_reqs]
        advance_decode(
            dev32["positions"][:num_reqs],
            dev32["seq_lens"][:num_reqs],
            dev64["slots"][:num_reqs],
            dev64["sample_slots"][:num_reqs],
            dev_rows,
            self.input_ids[:num_reqs],
            self.token_ids,
            self.block_table.gpu,
            self.block_size,
        )
        seq_lens = last.seq_lens.copy()
        seq_lens[:num_reqs] += 1
        last.seq_lens = seq_lens
        max_cols = int(self.num_blocks[rows].max())
        metadata = CommonAttentionMetadata(
            num_reqs=pad_to,
            num_actual_tokens=pad_to,
            num_decodes=pad_to,
            num_decode_tokens=pad_to,
            query_start_loc=dev32["query_start_loc"][: pad_to + 1],
            query_start_loc_cpu=last.query_start_loc,
            seq_lens=dev32["seq_lens"][:pad_to],
            seq_lens_cpu=torch.from_numpy(seq_lens),
            max_query_len=1,
            max_seq_len=int(seq_lens[:num_reqs].max()),
            block_table=self.block_table.gpu[dev64["rows"][:pad_to], :max_cols],
            slot_mapping=dev64["slots"][:pad_to],
        )
        self._pending = _PendingStep(rows, dev64["sample_slots"][:num_reqs])
        sampling_metadata = last.sampling_metadata
        if sampling_metadata is None:
            sampling_metadata = self._sampling_metadata(rows, dev_rows)
        starts = self.num_computed[rows]
        self.num_computed[rows] += 1
        self.num_tokens[rows] += 1
        if last.sampling_metadata is None and self._sampling_is_static(rows):
            last.sampling_metadata = sampling_metadata
        self.num_advanced_steps += 1
        return ModelInputs(
            input_ids=self.input_ids[:pad_to],
            positions=dev32["positions"][:pad_to],
            attn_metadata=metadata,
            logits_indices=None,
            sampling_request_indices=list(last.sampling_request_indices),
            sampling_metadata=sampling_metadata,
            num_tokens=num_reqs,
            query_starts=starts,
            prompt_logprob_indices=np.flatnonzero(self.wants_prompt_logprobs[rows]).tolist(),
        )

    def _sampling_is_static(self, sample_rows: np.ndarray) -> bool:
        """Whether these rows' sampling metadata stays valid for their next decode step: nothing in it
        follows the tokens generated so far. Penalties count them, bad words match their suffix, and
        min_tokens suppresses EOS until enough are out. A feature adding per-step sampler inputs must
        return False here for the rows that use it."""
        if self.has_penalties[sample_rows].any() or self.has_bad_words[sample_rows].any():
            return False
        num_output = self.num_tokens[sample_rows] - self.num_prompt_tokens[sample_rows]
        return not (num_output < self.min_tokens[sample_rows] + 1).any()

    def capture_metadata(self, num_reqs: int, query_len: int = 1) -> CommonAttentionMetadata:
        """A uniform-decode batch of `num_reqs` dummy requests for CUDA-graph capture: each has
        `query_len` tokens at positions 0.. that read block 0 and write nothing (slot -1)."""
        num_tokens = num_reqs * query_len
        if num_reqs > self.max_num_reqs or num_tokens > self.max_num_tokens:
            raise ValueError(
                f"cannot capture {num_reqs} requests of {query_len} tokens: the batch holds "
                f"{self.max_num_reqs} requests, {self.max_num_tokens} tokens"
            )
        i32 = self._i32_layout.views(self.step_i32.next_host_numpy())
        i64 = self._i64_layout.views(self.step_i64.next_host_numpy())
        self.input_ids[:num_tokens] = 0
        i32["positions"][:num_tokens] = np.tile(np.arange(query_len), num_reqs)
        i32["query_start_loc"][: num_reqs + 1] = np.arange(num_reqs + 1) * query_len
        i32["seq_lens"][:num_reqs] = query_len
        i64["slots"][:num_tokens] = -1
        i64["rows"][:num_reqs] = 0
        dev32 = self._i32_layout.views(self.step_i32.upload())
        dev64 = self._i64_layout.views(self.step_i64.upload())
        cpu32 = self._i32_layout.views(self.step_i32.host)
        return CommonAttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            num_decodes=num_reqs,
            num_decode_tokens=num_tokens,
            query_start_loc=dev32["query_start_loc"][: num_reqs + 1],
            query_start_loc_cpu=cpu32["query_start_loc"][: num_reqs + 1],
            seq_lens=dev32["seq_lens"][:num_reqs],
            seq_lens_cpu=cpu32["seq_lens"][:num_reqs],
            max_query_len=query_len,
            max_seq_len=query_len,
            block_table=torch.zeros(
                (num_reqs, -(-query_len // self.block_size)), dtype=torch.int32, device=self.device
            ),
            slot_mapping=dev64["slots"][:num_tokens],
            decode_query_len=query_len,
        )

    def prefill_capture_metadata(self, num_tokens: int) -> CommonAttentionMetadata:
        """One dummy request of `num_tokens` prompt tokens (positions 0..n-1) that reads block 0 and
        writes nothing (slot -1): the warm-up batch of a piecewise CUDA-graph capture."""
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"cannot capture {num_tokens} tokens: the batch holds {self.max_num_tokens}")
        i32 = self._i32_layout.views(self.step_i32.next_host_numpy())
        i64 = self._i64_layout.views(self.step_i64.next_host_numpy())
        self.input_ids[:num_tokens] = 0
        i32["positions"][:num_tokens] = np.arange(num_tokens)
        i32["query_start_loc"][:2] = (0, num_tokens)
        i32["seq_lens"][:1] = num_tokens
        i64["slots"][:num_tokens] = -1
        dev32 = self._i32_layout.views(self.step_i32.upload())
        dev64 = self._i64_layout.views(self.step_i64.upload())
        cpu32 = self._i32_layout.views(self.step_i32.host)
        num_cols = -(-num_tokens // self.block_size)
        return CommonAttentionMetadata(
            num_reqs=1,
            num_actual_tokens=num_tokens,
            num_decodes=1 if num_tokens == 1 else 0,
            num_decode_tokens=1 if num_tokens == 1 else 0,
            query_start_loc=dev32["query_start_loc"][:2],
            query_start_loc_cpu=cpu32["query_start_loc"][:2],
            seq_lens=dev32["seq_lens"][:1],
            seq_lens_cpu=cpu32["seq_lens"][:1],
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            block_table=torch.zeros((1, num_cols), dtype=torch.int32, device=self.device),
            slot_mapping=dev64["slots"][:num_tokens],
        )

    @property
    def slot_mapping(self) -> torch.Tensor:
        """The device buffer every step's slot mapping is uploaded to (fixed address)."""
        return self._i64_layout.views(self.step_i64.gpu)["slots"]

    @property
    def positions(self) -> torch.Tensor:
        """The device buffer every step's positions are uploaded to (fixed address, as input_ids)."""
        return self._i32_layout.views(self.step_i32.gpu)["positions"]

    def _sampling_metadata(self, sample_rows: np.ndarray, index: torch.Tensor) -> SamplingMetadata:
        """The sampled rows' parameters: flags from the host copies, tensors gathered on the device
        (`index`: the rows, int64 on the device)."""
        num = len(sample_rows)
        greedy = self.is_greedy.np[sample_rows]
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())

        def gather(buffer: CpuGpuBuffer) -> torch.Tensor:
            return buffer.gpu.index_select(0, index)

        temperature = top_k = top_p = min_p = None
        max_top_k, all_top_k = 0, False
        if not all_greedy:
            if (self.temperature.np[sample_rows] != 1.0).any():
                temperature = gather(self.temperature)
            ks = self.top_k.np[sample_rows]
            active_k = ks < self.vocab_size
            if active_k.any():
                top_k = gather(self.top_k)
                max_top_k = int(ks[active_k].max())
                all_top_k = bool(active_k.all())
            if (self.top_p.np[sample_rows] < 1.0).any():
                top_p = gather(self.top_p)
            if (self.min_p.np[sample_rows] > 0.0).any():
                min_p = gather(self.min_p)
        states = self.row_states
        generators = {
            int(i): states[sample_rows[i]].generator for i in np.flatnonzero(self.has_generator[sample_rows])
        }
        num_output = self.num_tokens[sample_rows] - self.num_prompt_tokens[sample_rows]
        suppressed = []
        for i in np.flatnonzero(num_output < self.min_tokens[sample_rows]).tolist():
            state = states[sample_rows[i]]
            eos = () if state.params.ignore_eos else state.eos_token_ids
            suppressed.append((i, [*eos, *state.params.stop_token_ids]))
        penalties = None
        penalised = np.flatnonzero(self.has_penalties[sample_rows])
        if len(penalised):
            pen_rows = sample_rows[penalised]
            known = self.num_tokens[pen_rows].copy()  # this step's count, before its sample joins
            params = [states[r].params for r in sample_rows.tolist()]
            penalties = penalty_inputs(
                params,
                penalised.tolist(),
                num,
                self.device,
                lambda vocab: self._token_counts(pen_rows, known, vocab),
            )
        num_logprobs = self.num_logprobs[sample_rows]
        wants_logprobs = bool((num_logprobs >= 0).any())
        allowed = self._allowed_inputs(sample_rows)
        bad_words = self._bad_word_inputs(sample_rows)
        logit_bias = self._logit_bias_inputs(sample_rows)
        return SamplingMetadata(
            num_rows=num,
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=None if all_greedy or all_random else gather(self.is_greedy),
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            all_top_k=all_top_k,
            top_p=top_p,
            min_p=min_p,
            generators=generators,
            penalties=penalties,
            suppressed=suppressed,
            allowed=allowed,
            bad_words=bad_words,
            logit_bias=logit_bias,
            num_logprobs=[None if k < 0 else k for k in num_logprobs.tolist()] if wants_logprobs else None,
            need_sampled_logprobs=wants_logprobs,
        )

    # Each of these costs one numpy test over the sampled rows when no row uses its feature, and
    # work proportional to the rows (and their entries) that do otherwise.

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        return upload_from_host(torch.from_numpy(np.ascontiguousarray(values)), self.device)

    def _allowed_inputs(self, sample_rows: np.ndarray) -> AllowedTokenInputs | None:
        restricted = np.flatnonzero(self.has_allowed_token_ids[sample_rows])
        if not len(restricted):
            return None
        assert self._disallowed is not None  # written when the first such request joined
        return AllowedTokenInputs(
            rows=None if len(restricted) == len(sample_rows) else self._upload(restricted),
            disallowed=self._disallowed.index_select(0, self._upload(sample_rows[restricted])),
        )

    def _bad_word_inputs(self, sample_rows: np.ndarray) -> BadWordInputs | None:
        banning = np.flatnonzero(self.has_bad_words[sample_rows])
        if not len(banning):
            return None
        rows = sample_rows[banning]
        num_output = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        states = self.row_states
        table = bad_word_table(
            [
                (i, states[row].bad_words, n)  # type: ignore[union-attr]
                for i, row, n in zip(banning.tolist(), rows.tolist(), num_output.tolist())
            ]
        )
        if table is None:
            return None
        # Each entry's last `width` tokens, read from the device token table (the host may not know
        # the last one yet); positions before the output fall under -1 prefixes and are not compared.
        entry_rows = rows[table.sources]
        width = table.width
        positions = self.num_tokens[entry_rows][:, None] - width + np.arange(width)[None, :]
        flat = entry_rows[:, None] * self.max_model_len + np.maximum(positions, 0)
        recent = self.token_ids.view(-1).index_select(0, self._upload(flat.reshape(-1)))
        return table.inputs(recent.view(len(entry_rows), width).long(), self.device)

    def _logit_bias_inputs(self, sample_rows: np.ndarray) -> LogitBiasInputs | None:
        biased = np.flatnonzero(self.has_logit_bias[sample_rows])
        if not len(biased):
            return None
        states = self.row_states
        entries = [
            (i, states[row].logit_bias) for i, row in zip(biased.tolist(), sample_rows[biased].tolist())
        ]
        return logit_bias_inputs(entries, self.device)  # type: ignore[arg-type]

    def _token_counts(
        self, rows: np.ndarray, num_tokens: np.ndarray, vocab_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt and output token counts of the given rows, from the device token table."""
        device = self.device
        num_prompt = self.num_prompt_tokens[rows]
        width = int(num_tokens.max())
        index = torch.from_numpy(rows).to(device)
        tokens = self.token_ids.index_select(0, index)[:, :width].long()
        positions = torch.arange(width, device=device)
        prompt_len = torch.from_numpy(num_prompt).to(device).unsqueeze(1)
        total_len = torch.from_numpy(num_tokens).to(device).unsqueeze(1)
        outside = torch.full_like(tokens, vocab_size)
        # Ids outside [0, vocab) (and positions outside each span) land in the extra column.
        valid = (tokens >= 0) & (tokens < vocab_size)
        prompt_ids = torch.where(valid & (positions < prompt_len), tokens, outside)
        output_ids = torch.where(valid & (positions >= prompt_len) & (positions < total_len), tokens, outside)
        ones = torch.ones_like(tokens, dtype=torch.float32)
        shape = (len(rows), vocab_size + 1)
        prompt = torch.zeros(shape, dtype=torch.float32, device=device).scatter_add_(1, prompt_ids, ones)
        output = torch.zeros(shape, dtype=torch.float32, device=device).scatter_add_(1, output_ids, ones)
        return prompt[:, :vocab_size], output[:, :vocab_size]

    # ---- after the forward pass ---------------------------------------------------------------------

    def record_sampled_on_device(self, token_ids: torch.Tensor) -> None:
        """Write the step's sampled ids into the device token table, where the next step reads them."""
        pending = self._pending
        if len(pending.sample_rows):
            self.token_ids.view(-1).index_copy_(0, pending.sample_slots, token_ids.to(torch.int32))


@dataclass
class _PendingStep:
    """What `record_sampled_on_device` needs of the step `prepare` built."""

    sample_rows: np.ndarray  # rows that sample this step, in sampling order
    sample_slots: torch.Tensor  # int64 flat positions of their next token in the device token table


def _leading_ones(query_lens: np.ndarray) -> int:
    """How many requests at the front have exactly one query token (the decodes)."""
    not_one = np.flatnonzero(query_lens != 1)
    return int(not_one[0]) if len(not_one) else len(query_lens)
