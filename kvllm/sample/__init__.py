"""Sampling: logits processing (penalties, temperature, top-k/top-p/min-p), token choice and logprobs."""
