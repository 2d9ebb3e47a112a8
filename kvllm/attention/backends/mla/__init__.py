"""MLA (Multi-head Latent Attention, DeepSeek-V2/V3) backends.

Every MLA backend shares one cache layout and one model-side contract (`common.py`,
`common_impl.py`): per layer, one latent tensor `(num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim)` holding the normalised compressed KV followed by the rotated shared key.
Decode attends in the latent space with absorbed weights; prefill up-projects the latent to full
keys and values and runs a prefill backend (`prefill.py`). A backend module declares (no torch);
its `*_impl` module supplies the decode kernel.
"""
