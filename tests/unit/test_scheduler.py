"""Scheduler: token budget, decodes first, chunked prefill, admission limits and preemption."""

import pytest

from kvllm.core.kv_cache_manager import KVCacheManager
from kvllm.core.request import Request, RequestStatus
from kvllm.core.scheduler import Scheduler
from kvllm.sampling_params import SamplingParams


def make_request(rid: str, num_tokens: int, offset: int = 0) -> Request:
    return Request(
        rid, [offset + i + 1 for i in range(num_tokens)], SamplingParams(), max_tokens=100, eos_token_ids=(0,)
    )


def run_step(scheduler: Scheduler):
    """Schedule, pretend the model ran, and sample one token for requests that reached their end
    (the scheduler left a placeholder for each), as the synchronous engine does."""
    out = scheduler.schedule()
    for item in out.scheduled:
        r = item.request
        if r.num_output_placeholders:
            r.resolve_placeholder()
            r.append_output_token(7)
    return out


def test_chunked_prefill_respects_budget_and_puts_decodes_first():
    kv = KVCacheManager(100, 4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    s.add_request(make_request("a", 3))
    s.add_request(make_request("b", 25))
    out = run_step(s)
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 3), ("b", 7)]
    out = run_step(s)
    # "a" now decodes (1 token) and goes first; "b" continues its prefill with the rest of the budget.
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_scheduled_tokens <= 10


def test_chunked_prefill_off_waits_for_whole_prompt():
    kv = KVCacheManager(100, 4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add_request(make_request("a", 6))
    s.add_request(make_request("b", 6))
    out = run_step(s)
    assert [i.request.request_id for i in out.scheduled] == ["a"]


def test_max_num_seqs_limits_running():
    kv = KVCacheManager(100, 4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 3, offset=10 * i))
    run_step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_preemption_recomputes_newest_and_frees_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_request("a", 8), make_request("b", 8, offset=50)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefilled: 2 blocks each, cache full; both hold 9 tokens after sampling
    assert kv.num_free_blocks == 0
    out = run_step(s)  # decoding "a" at position 8 needs a 3rd block: "b" is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and s.num_preemptions == 1
    assert [i.request.request_id for i in out.scheduled] == ["a"]
    s.finish_request(a)
    out = run_step(s)  # "b" is recomputed: prompt plus its sampled token
    assert out.scheduled[0].request is b and out.scheduled[0].num_new_tokens == 9
    s.finish_request(b)
    assert kv.num_free_blocks == 4


def test_prefix_hits_are_counted_once_per_request():
    kv = KVCacheManager(num_blocks=50, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    s.add_request(make_request("a", 13))
    run_step(s)
    s.add_request(make_request("b", 13))
    run_step(s)
    assert kv.prefix_cache_queries == 26
    assert kv.prefix_cache_hits == 12


def test_in_flight_tokens_are_scheduled_on_and_max_tokens_stops_in_time():
    """Overlapped scheduling: the next step is scheduled before this step's tokens are known."""
    kv = KVCacheManager(100, 4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    r = Request("a", [1, 2, 3], SamplingParams(), max_tokens=3, eos_token_ids=(0,))
    s.add_request(r)
    first = s.schedule()  # prefill: its token will be sampled
    assert first.scheduled[0].num_new_tokens == 3 and r.num_output_placeholders == 1
    second = s.schedule()  # decodes the in-flight token (position 3) before its id is known
    assert [(i.request.request_id, i.num_new_tokens) for i in second.scheduled] == [("a", 1)]
    assert r.num_computed_tokens == 4 and r.num_output_placeholders == 2
    third = s.schedule()  # 2 in flight; max_tokens 3 allows one more
    assert third.scheduled and r.num_output_placeholders == 3
    assert s.schedule().is_empty  # 3 tokens in flight reach max_tokens: nothing more to compute
    for _ in range(3):
        r.resolve_placeholder()
        r.append_output_token(5)
    assert r.num_output_placeholders == 0 and r.num_computed_tokens == 5  # the last token needs no KV


def test_a_request_preempted_with_a_token_in_flight_waits_for_it():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_request("a", 8), make_request("b", 8, offset=50)
    s.add_request(a)
    s.add_request(b)
    s.schedule()  # both prefilled, both have a token in flight
    out = s.schedule()  # "a" decodes into a 3rd block: "b" is preempted with its token unknown
    assert [r.request_id for r in out.preempted] == ["b"] and b.num_output_placeholders == 1
    s.finish_request(a)
    assert s.schedule().is_empty  # "b" cannot be recomputed before its in-flight token arrives
    b.resolve_placeholder()
    b.append_output_token(7)
    out = s.schedule()
    assert out.scheduled[0].request is b and out.scheduled[0].num_new_tokens == 9


def test_a_request_that_outgrows_the_whole_cache_fails_and_the_queue_moves_on():
    """16 tokens of cache: "big" grows past it while decoding; it fails with "error" (no livelock)."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100)
    big, small = make_request("big", 12), make_request("small", 3, offset=50)
    s.add_request(big)
    s.add_request(small)
    outs = []
    while not small.num_output_tokens and len(outs) < 30:
        outs.append(run_step(s))
    assert small.num_output_tokens == 1, "the request queued behind the one that cannot fit never ran"
    assert [r for out in outs for r in out.failed] == [big]
    assert big.is_finished and big.finish_reason == "error"
    assert "17 tokens" in big.stop_reason and "16 tokens" in big.stop_reason
    s.finish_request(small)
    assert kv.num_free_blocks == 4


def test_a_prompt_longer_than_the_whole_cache_fails_instead_of_blocking_the_queue():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    huge, small = make_request("huge", 20), make_request("small", 3, offset=50)
    s.add_request(huge)
    s.add_request(small)
    out = run_step(s)
    assert [i.request for i in out.scheduled] == [small]
    assert out.failed == [huge] and huge.finish_reason == "error"


def prioritized(rid: str, num_tokens: int, priority: int, arrival: float, offset: int = 0) -> Request:
    request = make_request(rid, num_tokens, offset)
    request.priority, request.arrival_time = priority, arrival
    return request


def test_priority_policy_admits_by_priority_then_arrival():
    kv = KVCacheManager(100, 4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100, policy="priority")
    for rid, priority, arrival in [
        ("late-low", 5, 1.0),
        ("urgent", -1, 3.0),
        ("mid", 2, 2.0),
        ("early-low", 5, 0.5),
    ]:
        s.add_request(prioritized(rid, 3, priority, arrival, offset=10 * len(s.waiting)))
    admitted = []
    while s.waiting or s.running:
        out = run_step(s)
        admitted += [i.request.request_id for i in out.scheduled if i.request.request_id not in admitted]
        s.finish_requests(list(s.running))
    assert admitted == ["urgent", "mid", "early-low", "late-low"]

    fcfs = Scheduler(KVCacheManager(100, 4, enable_prefix_caching=False), 1, 100)
    for rid, priority, arrival in [("first", 5, 1.0), ("second", -1, 3.0)]:
        fcfs.add_request(prioritized(rid, 3, priority, arrival))
    assert [i.request.request_id for i in run_step(fcfs).scheduled] == ["first"]


def test_priority_policy_preempts_the_lowest_priority_running_request():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, policy="priority")
    # Admitted in this order (arrival), but "low" has the worst priority though it is not the newest.
    low, high, mid = (
        prioritized("low", 8, 9, 0.0),
        prioritized("high", 8, 0, 1.0, offset=50),
        prioritized("mid", 8, 4, 2.0, offset=100),
    )
    for r in (low, high, mid):
        s.add_request(r)
    run_step(s)  # all prefilled: 2 blocks each, cache full
    assert kv.num_free_blocks == 0 and [r.request_id for r in s.running] == ["high", "mid", "low"]
    out = run_step(s)  # "high" and "mid" each need a 3rd block: "low" goes first, then nothing else
    assert [r.request_id for r in out.preempted] == ["low"]
    assert low.status == RequestStatus.WAITING and low.num_computed_tokens == 0
    assert [i.request.request_id for i in out.scheduled] == ["high", "mid"]
    # Under fcfs the newest ("mid") would have been the victim.
    kv2 = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    f = Scheduler(kv2, max_num_seqs=8, max_num_batched_tokens=100)
    for r in (
        prioritized("low", 8, 9, 0.0),
        prioritized("high", 8, 0, 1.0, 50),
        prioritized("mid", 8, 4, 2.0, 100),
    ):
        f.add_request(r)
    run_step(f)
    assert [r.request_id for r in run_step(f).preempted] == ["mid"]


def test_a_preempted_request_waits_in_priority_order():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, policy="priority")
    a, b = prioritized("a", 8, 0, 0.0), prioritized("b", 8, 1, 1.0, offset=50)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    s.add_request(prioritized("newcomer-better", 3, 0, 5.0, offset=100))
    s.add_request(prioritized("newcomer-worse", 3, 3, 4.0, offset=150))
    out = run_step(s)  # "a" needs a block: "b" (priority 1) is preempted and queued by its priority
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [r.request_id for r in s.waiting] == ["newcomer-better", "b", "newcomer-worse"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling policy 'lifo' is not valid; allowed: fcfs, priority"):
        Scheduler(KVCacheManager(10, 4), 1, 10, policy="lifo")
