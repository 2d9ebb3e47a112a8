"""One-pass sampling from logits: argmax(logits / T + Gumbel noise), greedy rows argmax(logits).

argmax(log p + G) with G ~ Gumbel(0, 1) i.i.d. is a draw from p (the Gumbel-max trick, the same
exact race as the sampler's p / Exp(1)); with log p = logits / T - log Z the normaliser drops out,
so no softmax is computed: each row of logits is read once, in the model's dtype, by programs that
each take a chunk of the vocabulary; a second small kernel reduces their (value, index) pairs to one
token id per row. The noise is Philox keyed by a per-step seed and the element's (row, token id): one
Philox call (`tl.randint4x`) gives the four tokens 4j..4j+3 of a row their four words, so it needs no
state on the device and does not depend on the chunking. The Philox rounds, not the logits' bytes, bound
this kernel: with one call per token it took 119.6 ms of nano-vllm's run on an H200 (115 us a step), with
one per four tokens 78.7 ms on an H100 (same SM count and clock). Each element position keeps its running
best over a chunk's blocks, reduced across the program once at the chunk's end. Used for rows
without top-k / top-p / min-p and without a per-request seed; the sampler keeps the torch path for
everything else. A structured-output step passes its grammar bitmask in: forbidden tokens read as -inf,
so the masked logits are never written (no copy of the logits, no masking launch before the draw).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048
# Chunk programs to aim for, ~8 per SM of an H200 (132 SMs): a row splits into chunks of whole
# blocks, at batch 1 one block each (75 for Qwen3's vocabulary), at batch 256 four, from 1024 rows one.
TARGET_PROGRAMS = 1024


# A new seed every step, a chunking per batch size: one compiled variant for all.
@triton.jit(do_not_specialize=["seed", "blocks_per_chunk", "num_chunks"])
def _gumbel_chunk_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    is_greedy_ptr,
    chunk_best_ptr,
    chunk_index_ptr,
    vocab_size,
    blocks_per_chunk,
    num_chunks,
    seed,
    bitmask_ptr,
    stride_bitmask_row,
    bitmask_vocab,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_GREEDY: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    HAS_BITMASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = 1.0
    if HAS_TEMPERATURE:
        inv_t = 1.0 / tl.load(temperature_ptr + row).to(tl.float32)
    greedy = ALL_GREEDY
    if HAS_GREEDY:
        greedy = tl.load(is_greedy_ptr + row) != 0
    base = logits_ptr + row.to(tl.int64) * stride_row
    chunk_start = chunk * blocks_per_chunk * BLOCK
    chunk_end = tl.minimum(chunk_start + blocks_per_chunk * BLOCK, vocab_size)
    # A block as [BLOCK // 4, 4]: token start + 4j + lane. Each position keeps its running best over the
    # chunk's blocks (strictly greater: the earlier block wins a tie); one reduction at the end.
    quad = tl.arange(0, BLOCK // 4)
    lane = tl.arange(0, 4)
    run_best = tl.full([BLOCK // 4, 4], float("-inf"), tl.float32)
    run_index = tl.zeros([BLOCK // 4, 4], tl.int32) + chunk_start
    for start in range(chunk_start, chunk_end, BLOCK):
        offs = start + quad[:, None] * 4 + lane[None, :]
        in_vocab = offs < vocab_size
        x = tl.load(base + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        if not greedy:
            # Keyed by the token id (start is a multiple of 4), not its chunk: the draw does not depend
            # on the chunking. join(join(r0, r2), join(r1, r3)) puts word k on lane k.
            r0, r1, r2, r3 = tl.randint4x(seed, row * tl.cdiv(vocab_size, 4) + start // 4 + quad)
            bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK // 4, 4])
            u = tl.random.uint_to_uniform_float(bits)
            # -log(-log(u)): u = 0 gives -inf (never chosen), never NaN.
            x = x * inv_t - tl.log(-tl.log(u))
            x = tl.where(in_vocab, x, float("-inf"))
        # The grammar's mask: bit t % 32 of word t // 32 allows token t; tokens past its words never.
        if HAS_BITMASK:
            in_grammar = offs < bitmask_vocab
            words = tl.load(bitmask_ptr + row * stride_bitmask_row + (offs >> 5), mask=in_grammar, other=0)
            x = tl.where(in_grammar & (((words >> (offs & 31)) & 1) != 0), x, float("-inf"))
        better = x > run_best
        run_index = tl.where(better, offs, run_index)
        run_best = tl.where(better, x, run_best)
    # The chunk's first best token (as torch.argmax): the best value, then the smallest index holding it.
    best = tl.max(tl.max(run_best, axis=1), axis=0)
    best_index = tl.min(tl.min(tl.where(run_best == best, run_index, 2**31 - 1), axis=1), axis=0)
    # A chunk of -inf only (every token masked or noised to -inf): its first token, never chosen.
    best_index = tl.where(best == float("-inf"), chunk_start, best_index)
    tl.store(chunk_best_ptr + row * num_chunks + chunk, best)
    tl.store(chunk_index_ptr + row * num_chunks + chunk, best_index)


@triton.jit(do_not_specialize=["num_chunks"])
def _reduce_chunks_kernel(chunk_best_ptr, chunk_index_ptr, out_ptr, num_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS_PAD)
    in_row = offs < num_chunks
    best = tl.load(chunk_best_ptr + row * num_chunks + offs, mask=in_row, other=float("-inf"))
    index = tl.load(chunk_index_ptr + row * num_chunks + offs, mask=in_row, other=2**31 - 1)
    top = tl.max(best, axis=0)
    # On exact ties the smallest index, as torch.argmax.
    first = tl.min(tl.where(best == top, index, 2**31 - 1), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


def gumbel_sample(
    logits: torch.Tensor,  # [N, V], any float dtype, last dim contiguous
    temperature: torch.Tensor | None,  # float32 [N]; None = 1 for every row
    is_greedy: torch.Tensor | None,  # bool [N]; None = every row random (or all_greedy)
    seed: int,
    all_greedy: bool = False,
    num_chunks: int | None = None,  # chunks per row, at most one per block; None = automatic
    bitmask: torch.Tensor | None = None,  # int32 [>= N, W]: the grammar's allowed tokens (structured outputs)
) -> torch.Tensor:
    """One token id per row (int64 [N]): greedy rows argmax, the others a draw from softmax(logits / T).
    With `bitmask`, row i draws from the tokens bit t % 32 of bitmask[i, t // 32] allows (tokens past 32 W
    are forbidden): the same ids as masking the logits to -inf first.

    Two launches: (row, chunk) programs each find their chunk's best (value, index), then one program
    per row picks the best chunk. The ids do not depend on the number of chunks.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] with a contiguous last dimension, got {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    if vocab_size == 0:
        raise ValueError("logits have an empty vocabulary")
    if bitmask is not None and (
        bitmask.dtype != torch.int32
        or bitmask.dim() != 2
        or bitmask.shape[0] < num_rows
        or bitmask.stride(1) != 1
    ):
        raise ValueError(
            f"bitmask must be int32 [>= {num_rows}, words] with contiguous rows, got {bitmask.dtype} "
            f"{tuple(bitmask.shape)}"
        )
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_blocks = triton.cdiv(vocab_size, BLOCK_V)
    if num_chunks is None:
        num_chunks = triton.cdiv(TARGET_PROGRAMS, num_rows)
    blocks_per_chunk = triton.cdiv(num_blocks, min(max(num_chunks, 1), num_blocks))
    num_chunks = triton.cdiv(num_blocks, blocks_per_chunk)
    chunk_best = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_index = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    dummy = out
    _gumbel_chunk_kernel[(num_rows, num_chunks)](
        logits,
        logits.stride(0),
        temperature if temperature is not None else dummy,
        is_greedy.view(torch.uint8) if is_greedy is not None else dummy,
        chunk_best,
        chunk_index,
        vocab_size,
        blocks_per_chunk,
        num_chunks,
        seed,
        bitmask if bitmask is not None else dummy,
        bitmask.stride(0) if bitmask is not None else 0,
        min(bitmask.shape[1] * 32, vocab_size) if bitmask is not None else 0,
        HAS_TEMPERATURE=temperature is not None,
        HAS_GREEDY=is_greedy is not None,
        ALL_GREEDY=all_greedy,
        HAS_BITMASK=bitmask is not None,
        BLOCK=BLOCK_V,
        num_warps=8,
    )
    # The pad follows the vocabulary only, so one variant per model (at least 2 lanes).
    chunks_pad = max(2, triton.next_power_of_2(num_blocks))
    _reduce_chunks_kernel[(num_rows,)](
        chunk_best, chunk_index, out, num_chunks, CHUNKS_PAD=chunks_pad, num_warps=1
    )
    return out
