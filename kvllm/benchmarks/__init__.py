"""Benchmarks behind `kvllm bench`: latency, throughput (kvllm or HF transformers), serve, attention.

Every module here is importable without server-only packages (fastapi, uvicorn, pydantic), so the
GPU machine runs latency and throughput from the source tree with its own torch and transformers.
"""
