"""FLEX_ATTENTION: PyTorch FlexAttention over the paged KV cache, on the CPU and the GPU.

Declarations only: importable without torch. The kernel side (block-mask construction from the
block tables, torch.compile with bucketed shapes, an eager fallback) lives in
`flex_attention_impl`, imported when the backend is bound to a model.
"""

from __future__ import annotations

from kvllm.attention.backend import AttentionBackend, MultipleOf


class FlexAttentionBackend(AttentionBackend):
    """torch.nn.attention.flex_attention reading K/V straight from the paged cache.

    The KV "sequence" the kernel sees is the whole physical cache (num_blocks * block_size
    slots); a BlockMask built from the block tables tells it which pages each group of 16 query
    tokens touches, and a mask_mod maps every physical slot back to (request, position).
    On CUDA (unless KVLLM_FLEX_SPLIT_PATH=0), steps whose prefills have nothing cached split in two: the decodes take
    FlexAttention's decoding kernel (a batch of one-token queries over a decode-shaped BlockMask
    kept in the builder and updated on the device in place, shared by every layer and step:
    flex_attention_decode), the fresh prefills one packed call over the step's own K/V with large
    tiles (flex_attention_prefill).
    Capabilities below are what tests/kernels/test_flex_attention.py (CPU) and
    tests/gpu/test_flex_attention_gpu.py (CUDA) check against the float32 reference.
    """

    name = "FLEX_ATTENTION"
    version = ""
    description = (
        "PyTorch FlexAttention (torch.compile, eager fallback) with a block mask built from the block tables"
    )
    supported_dtypes = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16")
    # One FlexAttention KV tile is one page; 16 is the smallest tile the GPU kernel runs.
    block_sizes = MultipleOf(16)
    # FlexAttention's compiled GPU kernel rejects head sizes below 16 (E >= 16 in Inductor's lowering).
    head_sizes = MultipleOf(8, minimum=16)
    platforms = ("cuda", "rocm", "cpu")
    supports_sink = False
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_non_causal = True
    attn_types = ("decoder", "encoder_only")
    # The decode graph hooks exist (the builder's prepare_for_capture/replay over fixed buffers, the decode
    # masks updated on the device inside the graph) and pass on the CPU with eager replay; they become
    # "decode_only" once tests/gpu/test_cuda_graphs_gpu.py (which forces them on) has passed on a GPU.
    cudagraph_support = "never"
    required_package = None  # torch itself
    preferred_block_size = 16
    verified_on = "H200 (SM 9.0); CPU (CI)"

    impl_path = "kvllm.attention.backends.flex_attention_impl:FlexAttentionImpl"
    builder_path = "kvllm.attention.backends.flex_attention_impl:FlexAttentionMetadataBuilder"

    @classmethod
    def cudagraphs_off_reason(cls, device_type: str) -> str | None:
        from kvllm.attention.backends.flex_attention_impl import decode_graphs_off_reason

        return decode_graphs_off_reason(device_type)
