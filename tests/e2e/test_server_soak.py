"""A bounded soak of `kvllm serve` on a tiny random-weight model: 300 requests (completions and chat,
streamed or not, n of 1 or 2, up to 2 prompts), a third of them abandoned at random moments: before
the first byte, while being tokenized and added, after the first event, mid-stream. Seeded, so every
run sends the same traffic; it ends with 0 lost requests, 0 5xx and 0 KV blocks in use.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.e2e.test_server_openai import API_KEY, KV_USAGE, MODEL_NAME, RemoteServer, series, wait_until_idle

NUM_REQUESTS = 300
SEED = 14
CONCURRENCY = 32
# How a client gives up: cancel after a random delay (seconds), or close after some stream events.
EARLY_ABANDONS = {"before_first_byte": 0.003, "while_being_added": 0.03}
STREAM_ABANDONS = ("after_first_event", "mid_stream")


@dataclass
class Plan:
    index: int
    chat: bool
    stream: bool
    n: int
    num_prompts: int
    max_tokens: int
    abandon: str | None  # None: the client waits for the whole response
    delay: float = 0.0
    events_before_leaving: int = 0


@dataclass
class Outcome:
    plan: Plan
    status: int | None = None  # None: no response headers arrived
    completed: bool = False
    tokens: int = 0
    error: str | None = None  # an error event in a stream, or the client's exception


def make_plans(rng: random.Random) -> list[Plan]:
    abandoned = set(rng.sample(range(NUM_REQUESTS), NUM_REQUESTS // 3))
    modes = [*EARLY_ABANDONS, *STREAM_ABANDONS]
    plans = []
    for i in range(NUM_REQUESTS):
        chat = rng.random() < 0.4
        plan = Plan(
            index=i,
            chat=chat,
            stream=rng.random() < 0.5,
            n=rng.choice((1, 1, 2)),
            num_prompts=1 if chat else rng.choice((1, 1, 2)),
            max_tokens=rng.randint(1, 12),
            abandon=None,
        )
        if i in abandoned:
            plan.abandon = modes[i % len(modes)]
            if plan.abandon in EARLY_ABANDONS:
                plan.delay = rng.uniform(0, EARLY_ABANDONS[plan.abandon])
            else:
                plan.stream = True
                plan.max_tokens = max(plan.max_tokens, 4)
                plan.events_before_leaving = 1 if plan.abandon == "after_first_event" else rng.randint(2, 4)
        plans.append(plan)
    return plans


def request_of(plan: Plan) -> tuple[str, dict]:
    common = {"model": MODEL_NAME, "n": plan.n, "max_tokens": plan.max_tokens, "ignore_eos": True}
    common |= {"stream": plan.stream, "temperature": 0.8, "seed": plan.index}
    if plan.stream:
        common["stream_options"] = {"include_usage": True}
    if plan.chat:
        messages = [{"role": "user", "content": f"Soak request {plan.index}: tell me about the sea"}]
        return "/v1/chat/completions", {**common, "messages": messages}
    prompts = [f"Soak {plan.index}.{k}: once upon a time" for k in range(plan.num_prompts)]
    return "/v1/completions", {**common, "prompt": prompts[0] if len(prompts) == 1 else prompts}


async def send(client: httpx.AsyncClient, plan: Plan, outcome: Outcome) -> None:
    path, body = request_of(plan)
    if not plan.stream:
        response = await client.post(path, json=body)
        outcome.status = response.status_code
        if response.status_code == 200:
            outcome.tokens = response.json()["usage"]["completion_tokens"]
            outcome.completed = True
        return
    async with client.stream("POST", path, json=body) as response:
        outcome.status = response.status_code
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                outcome.completed = outcome.error is None
                return
            event = json.loads(data)
            if "error" in event:
                outcome.error = json.dumps(event["error"])
            elif event.get("usage"):
                outcome.tokens = event["usage"]["completion_tokens"]
            events += 1
            if plan.abandon in STREAM_ABANDONS and events >= plan.events_before_leaving:
                return  # leaving the block closes the connection mid-stream


async def run_one(client: httpx.AsyncClient, plan: Plan, slots: asyncio.Semaphore) -> Outcome:
    outcome = Outcome(plan)
    async with slots:
        try:
            if plan.abandon in EARLY_ABANDONS:
                await asyncio.wait_for(send(client, plan, outcome), plan.delay)
            else:
                await send(client, plan, outcome)
        except TimeoutError:
            pass  # an early abandon: the request task was cancelled, its connection closed
        except Exception as exc:  # recorded: a lost request if it was not abandoned
            outcome.error = repr(exc)
    return outcome


@pytest.fixture(scope="module")
def soak_server(tiny_qwen3_path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_qwen3_path, "--log-stats-interval", "0")
    try:
        yield srv
    finally:
        srv.stop()


def test_soak_with_abandoned_requests_loses_nothing_and_frees_every_block(soak_server):
    server = soak_server
    before = wait_until_idle(server)
    plans = make_plans(random.Random(SEED))

    async def main() -> list[Outcome]:
        slots = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(
            base_url=server.url, headers=headers, timeout=120, limits=limits
        ) as client:
            return await asyncio.gather(*[run_one(client, plan, slots) for plan in plans])

    start = time.monotonic()
    outcomes = asyncio.run(asyncio.wait_for(main(), 300))
    after = wait_until_idle(server, timeout=60)
    elapsed = time.monotonic() - start

    waited = [o for o in outcomes if o.plan.abandon is None]
    lost = [
        o for o in waited if not o.completed or o.tokens != o.plan.n * o.plan.num_prompts * o.plan.max_tokens
    ]
    server_errors = [o for o in outcomes if (o.status or 0) >= 500 or (o.error and '"code": 5' in o.error)]
    abandoned = Counter(o.plan.abandon for o in outcomes if o.plan.abandon)
    aborted = (
        after[series("vllm:request_success_total", finished_reason="abort")]
        - before[series("vllm:request_success_total", finished_reason="abort")]
    )
    print(
        f"\nsoak: {len(outcomes)} requests, {sum(abandoned.values())} abandoned {dict(abandoned)}, "
        f"{aborted:.0f} engine sequences aborted, {len(lost)} lost, {len(server_errors)} 5xx, "
        f"KV cache usage after {after[KV_USAGE]:.0%}, {elapsed:.1f} s"
    )
    assert len(outcomes) == NUM_REQUESTS and sum(abandoned.values()) == NUM_REQUESTS // 3
    assert not lost, [(o.plan, o.status, o.tokens, o.error) for o in lost[:5]]
    assert not server_errors, [(o.plan, o.status, o.error) for o in server_errors[:5]]
    assert after[KV_USAGE] == 0  # wait_until_idle also saw no request running or waiting
    assert aborted > 0  # some abandoned requests had reached the engine
    assert httpx.get(f"{server.url}/health").status_code == 200
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log
