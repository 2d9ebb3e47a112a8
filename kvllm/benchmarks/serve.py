"""`kvllm bench serve`: an asynchronous streaming client for any OpenAI-compatible server.

Random prompts (`--random-input-len` tokens, `--random-output-len` asked for), sent at a Poisson
`--request-rate` (inf: all at once) and/or at most `--max-concurrency` at a time, each streamed.
Measured per request: TTFT (time to first token), TPOT ((latency - TTFT) / (output tokens - 1)),
ITL (gaps between streamed chunks) and E2EL (end-to-end latency); reported with mean, median,
std and percentiles, and request and token throughput, in vLLM's block format.

Prompts are text when a tokenizer is at hand (`--tokenizer`, or the model if it is a local
folder): random ids decoded, as vLLM does; otherwise token-id lists, which the completions API
accepts. Output tokens are the server's `usage.completion_tokens` when it reports usage, else the
number of streamed chunks that carried text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvllm.benchmarks.datasets import random_requests
from kvllm.benchmarks.utils import add_flag, add_random_range_ratio_flag, environment, mean, percentile

REQUEST_TIMEOUT_S = 6 * 3600  # as vLLM's client: a benchmark request may queue for a long time
DEFAULT_PERCENTILES = "99"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The serving benchmark's own flags (vLLM's names); --model, --tokenizer, --seed are engine flags."""
    group = parser.add_argument_group("serving benchmark")
    add_flag(
        group,
        "base_url",
        default=None,
        help="Server URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT).",
    )
    group.add_argument("--host", default="127.0.0.1", help="Server host when --base-url is not given.")
    group.add_argument("--port", type=int, default=8000, help="Server port when --base-url is not given.")
    group.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="API path: /v1/completions or /v1/chat/completions (default: /v1/completions).",
    )
    add_flag(
        group,
        "served_model_name",
        default=None,
        help="Model name sent in requests (default: --model, else the server's first model).",
    )
    add_flag(
        group, "dataset_name", choices=("random",), default="random", help="Prompt source (default: random)."
    )
    add_flag(group, "num_prompts", type=int, default=1000, help="Number of requests (default: 1000).")
    add_flag(
        group, "random_input_len", type=int, default=1024, help="Prompt length in tokens (default: 1024)."
    )
    add_flag(
        group, "random_output_len", type=int, default=128, help="max_tokens of each request (default: 128)."
    )
    add_random_range_ratio_flag(group)
    add_flag(
        group,
        "request_rate",
        type=float,
        default=math.inf,
        help="Requests per second, Poisson arrivals; inf sends all at once (default: inf).",
    )
    add_flag(
        group,
        "max_concurrency",
        type=int,
        default=None,
        help="At most this many requests in flight (default: no limit).",
    )
    add_flag(
        group,
        "ignore_eos",
        action="store_true",
        help="Send ignore_eos=true (a vLLM extension) so every request generates max_tokens.",
    )
    group.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (default: 0).")
    add_flag(
        group,
        "percentile_metrics",
        default="ttft,tpot,itl,e2el",
        help="Metrics to report percentiles of (default: all).",
    )
    add_flag(
        group,
        "metric_percentiles",
        default=DEFAULT_PERCENTILES,
        help="Comma-separated percentiles (default: 99).",
    )
    add_flag(
        group,
        "save_result",
        action="store_true",
        help="Write the results (with per-request data) to a JSON file.",
    )
    add_flag(group, "result_dir", default=None, help="Folder for --save-result (default: current folder).")
    add_flag(
        group,
        "result_filename",
        default=None,
        help="File name for --save-result (default: kvllm-serve-<rate>qps-<date>.json).",
    )
    group.add_argument(
        "--launch-server",
        dest="launch_server",
        action="store_true",
        help="Start `kvllm serve` with the given engine arguments on a free port, "
        "benchmark it and stop it (compares engine settings end to end).",
    )
    group.add_argument(
        "--server-timeout",
        dest="server_timeout",
        type=float,
        default=600.0,
        help="Seconds to wait for a launched server to come up (default: 600).",
    )


@dataclass
class RequestResult:
    """What one streamed request measured (seconds)."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""


def _payload(
    args: argparse.Namespace, model: str, prompt: str | list[int], max_tokens: int
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint.rstrip("/").endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(chunk: dict[str, Any]) -> str | None:
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


async def send_request(client: Any, url: str, body: dict[str, Any], prompt_len: int) -> RequestResult:
    """Stream one request; time its first chunk with text, each later chunk, and the end."""
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    num_chunks = 0
    usage_tokens = None
    texts: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = (
                    f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                )
                return result
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                text = _chunk_text(chunk)
                if not text:
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                num_chunks += 1
                texts.append(text)
        result.latency = time.perf_counter() - start
        result.generated_text = "".join(texts)
        result.output_len = usage_tokens if usage_tokens is not None else num_chunks
        result.success = num_chunks > 0
        if not result.success:
            result.error = "the stream carried no text"
    except Exception as exc:  # a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _arrivals(num: int, rate: float, rng: random.Random):
    """Yield request indices at Poisson arrival times (exponential gaps of mean 1/rate)."""
    for i in range(num):
        yield i
        if math.isfinite(rate) and i + 1 < num:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(
    args: argparse.Namespace,
    base_url: str,
    model: str,
    prompts: list[tuple[str | list[int], int, int]],
    seed: int = 0,
) -> tuple[list[RequestResult], float]:
    """Send every prompt (prompt, prompt_len, max_tokens); returns the results and the wall time."""
    import httpx

    url = base_url.rstrip("/") + args.endpoint
    limit = args.max_concurrency or len(prompts)
    semaphore = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        test = await send_request(client, url, _payload(args, model, prompts[0][0], 1), prompts[0][1])
        if not test.success:
            raise ValueError(
                f"the first test request to {url} failed ({test.error}); is the server up and "
                f"--endpoint/--model right?"
            )

        async def limited(i: int) -> RequestResult:
            prompt, prompt_len, max_tokens = prompts[i]
            async with semaphore:
                return await send_request(client, url, _payload(args, model, prompt, max_tokens), prompt_len)

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(prompts), args.request_rate, rng):
            tasks.append(asyncio.create_task(limited(i)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return results, duration


def compute_metrics(
    results: list[RequestResult], duration: float, args: argparse.Namespace
) -> dict[str, Any]:
    """vLLM's serving metrics (milliseconds) from the per-request results."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    series = {
        "ttft": [r.ttft * 1000 for r in ok],
        "tpot": [(r.latency - r.ttft) * 1000 / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [gap * 1000 for r in ok for gap in r.itl],
        "e2el": [r.latency * 1000 for r in ok],
    }
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = sorted(set(selected) - set(series))
    if unknown:
        raise ValueError(
            f"--percentile-metrics: unknown {', '.join(unknown)}; allowed: ttft, tpot, itl, e2el"
        )
    quantiles = [float(q) for q in args.metric_percentiles.split(",") if q.strip()]
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, values in series.items():
        metrics[f"mean_{name}_ms"] = mean(values) if values else 0.0
        metrics[f"median_{name}_ms"] = percentile(values, 50) if values else 0.0
        spread = mean([(v - metrics[f"mean_{name}_ms"]) ** 2 for v in values]) if values else 0.0
        metrics[f"std_{name}_ms"] = math.sqrt(spread)
        for q in quantiles:
            metrics[f"p{q:g}_{name}_ms"] = percentile(values, q) if values else 0.0
    metrics["selected_percentile_metrics"] = selected
    metrics["selected_percentiles"] = quantiles
    return metrics


_SECTIONS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def format_result(metrics: dict[str, Any], args: argparse.Namespace) -> str:
    """The result block exactly in vLLM's layout."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label: str, value: float) -> None:
        lines.append(f"{label:<40} {value:<10}" if isinstance(value, int) else f"{label:<40} {value:<10.2f}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if args.max_concurrency is not None:
        row("Maximum request concurrency:", args.max_concurrency)
    if math.isfinite(args.request_rate):
        row("Request rate configured (RPS):", args.request_rate)
    row("Benchmark duration (s):", metrics["duration"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total Token throughput (tok/s):", metrics["total_token_throughput"])
    for name in metrics["selected_percentile_metrics"]:
        title, short = _SECTIONS[name]
        lines.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", metrics[f"median_{name}_ms"])
        for q in metrics["selected_percentiles"]:
            row(f"P{q:g} {short} (ms):", metrics[f"p{q:g}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def _load_tokenizer(name: str | None) -> Any:
    if name is None or not Path(name).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):
        return None


async def _server_model(base_url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --served-model-name")
    return models[0]["id"]


def make_prompts(
    args: argparse.Namespace,
    tokenizer: Any,
    vocab_size: int,
    seed: int = 0,
) -> list[tuple[str | list[int], int, int]]:
    """(prompt, prompt length in tokens, max_tokens) for each request."""
    requests = random_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        vocab_size,
        seed=seed,
        range_ratio=args.random_range_ratio,
    )
    prompts: list[tuple[str | list[int], int, int]] = []
    for r in requests:
        if tokenizer is None:
            prompts.append((r.prompt_token_ids, r.prompt_len, r.output_len))
        else:
            text = tokenizer.decode(r.prompt_token_ids)
            prompts.append((text, len(tokenizer(text, add_special_tokens=False).input_ids), r.output_len))
    return prompts


def benchmark(
    args: argparse.Namespace, base_url: str, model_arg: str | None, tokenizer_arg: str | None, seed: int = 0
) -> dict[str, Any]:
    """Run the whole serving benchmark against `base_url` and return the result record."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts={args.num_prompts} is not valid; allowed: >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} is not valid; allowed: >= 1")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate={args.request_rate} is not valid; allowed: > 0 or inf")
    model = args.served_model_name or model_arg or asyncio.run(_server_model(base_url))
    tokenizer = _load_tokenizer(tokenizer_arg or model_arg)
    vocab = len(tokenizer) if tokenizer is not None else 10000
    prompts = make_prompts(args, tokenizer, vocab, seed)
    print(
        f"Benchmarking {base_url}{args.endpoint} (model {model!r}): {len(prompts)} requests, "
        f"request rate {args.request_rate}, max concurrency {args.max_concurrency}"
    )
    results, duration = asyncio.run(run_benchmark(args, base_url, model, prompts, seed))
    metrics = compute_metrics(results, duration, args)
    return {
        "benchmark": "serve",
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer": tokenizer_arg or model_arg if tokenizer is not None else None,
        "prompt_format": "token_ids" if tokenizer is None else "text",
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "env": environment(),
    }


def result_path(args: argparse.Namespace) -> Path:
    if args.result_filename:
        name = args.result_filename
    else:
        rate = "inf" if not math.isfinite(args.request_rate) else f"{args.request_rate:g}"
        name = f"kvllm-serve-{rate}qps-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return Path(args.result_dir or ".") / name


def save(result: dict[str, Any], args: argparse.Namespace) -> Path:
    path = result_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"Results written to {path}")
    return path
