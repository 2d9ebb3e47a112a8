"""vLLM's `vllm.v1` import paths, so code copied from vLLM's docs imports unchanged with `kvllm`."""
