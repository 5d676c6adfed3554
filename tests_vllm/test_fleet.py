"""Two vLLM replicas with the connector sharing a Redis segment tier (a real redis-server,
started here), and the affinity router in front of them."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from kvcomm_agents.testing import local_redis

from .conftest import questions, serving


@pytest.fixture(scope="module")
def fleet_urls():
    with ExitStack() as stack:
        redis_url = stack.enter_context(local_redis())
        urls = [stack.enter_context(serving("--shared-store", redis_url)) for _ in range(2)]
        yield urls


def test_a_replica_serves_another_replicas_prefix_from_the_shared_tier(fleet_urls):
    from kvcomm_vllm.client import VLLMEngine

    one, two = VLLMEngine(fleet_urls[0]), VLLMEngine(fleet_urls[1])
    first = [{"role": "system", "content": "You are a careful solver."}, {"role": "user", "content": questions(3)[2]}]
    reply = one.chat(first, agent="solver", max_new_tokens=16)
    follow = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Final answer only?"}]
    served = two.chat(follow, agent="solver", max_new_tokens=12)  # replica 2 never saw the first turn
    dense = two.chat(follow, agent="solver", max_new_tokens=12, reuse=False)
    assert served.stats.prefix_tokens >= served.stats.prompt_tokens // 2, served.stats
    assert served.token_ids == dense.token_ids  # an exact prefix: vLLM's own greedy output


def test_the_router_sends_a_follow_up_where_its_first_turn_ran(fleet_urls):
    from kvcomm_vllm.fleet import FleetEngine

    fleet = FleetEngine(fleet_urls)
    first = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": questions(4)[3]}]
    reply = fleet.chat(first, agent="solver", max_new_tokens=16)
    fleet.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}],
               agent="other", max_new_tokens=4)
    follow = fleet.chat(first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Sure?"}],
                        agent="checker", max_new_tokens=4)
    assert sorted(fleet.served) == [1, 2]
    assert follow.stats.reused_tokens > 0
