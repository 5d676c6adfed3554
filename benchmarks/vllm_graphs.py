"""How one graph (or a set of graphs) runs on an engine for ``benchmarks.vllm_serving``, and the
records each protocol writes: one graph at a time on vLLM (:func:`ttft_graph`) or the HF engine
(:func:`hf_graph`), the connector's hooks timed per graph (:func:`timed_hooks`), several graphs
as users send them (:func:`stream_graphs`)."""

from __future__ import annotations

import time


def report_of(output) -> dict:
    """The connector's report of a vLLM ``RequestOutput`` (empty without the connector)."""
    return (output.kv_transfer_params or {}).get("kvcomm", {})


#: the connector's hooks ``--time-hooks`` times: planning, loading, capture
HOOKS = ("get_num_new_matched_tokens", "start_load_kv", "request_finished")


def timed_hooks() -> dict[str, float]:
    """Wrap the connector's :data:`HOOKS` with a timer, in this process (before the engine
    starts); returns the seconds spent in each so far, updated as they run."""
    from kvcomm_vllm.connector import KVCommConnector

    totals = dict.fromkeys(HOOKS, 0.0)
    for name in HOOKS:
        def timed(self, *args, _hook=getattr(KVCommConnector, name), _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _hook(self, *args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - started

        setattr(KVCommConnector, name, timed)
    return totals


def with_hook_times(graph, totals: dict[str, float]):
    """``graph`` (a runner) whose wall-time record also holds the milliseconds each hook took."""

    def run(engine, request, index: int, reply_tokens: int) -> list[dict]:
        before = dict(totals)
        records = graph(engine, request, index, reply_tokens)
        records[-1]["hooks_ms"] = {name: (totals[name] - before[name]) * 1000 for name in HOOKS}
        return records

    return run


def ttft_graph(engine, request, index: int, reply_tokens: int) -> list[dict]:
    """One graph through a vLLM ``engine`` (:class:`~benchmarks.vllm_driver.VLLMDriver`): a
    record per agent call, then the graph's wall time."""
    records, replies, started = [], [], time.perf_counter()
    for k, agent in enumerate(request.agents):
        ids = engine.ids(request.messages(k, replies))
        out = engine.generate([ids], [agent], reply_tokens)[0]
        replies.append(out.outputs[0].text)
        records.append({"graph": index, "agent_index": k + 1, "prompt_tokens": len(ids),
                        "reused_tokens": report_of(out).get("reused_tokens", out.num_cached_tokens or 0),
                        "ttft_s": out.metrics.first_token_latency})
    records.append({"graph": index, "wall_s": time.perf_counter() - started})
    return records


def hf_graph(engine, request, index: int, reply_tokens: int) -> list[dict]:
    """One graph through the HF ``engine`` (:class:`~kvcomm_agents.KVCommEngine`), recorded as
    :func:`ttft_graph` records it (plus each call's audit KL, where one ran)."""
    records, replies, started = [], [], time.perf_counter()
    for k, agent in enumerate(request.agents):
        result = engine.chat(request.messages(k, replies), agent=agent, max_new_tokens=reply_tokens, temperature=0.0)
        replies.append(result.text)
        s = result.stats
        records.append({"graph": index, "agent_index": k + 1, "prompt_tokens": s.prompt_tokens,
                        "reused_tokens": s.reused_tokens, "ttft_s": s.ttft_s, "kl": s.audit_kl})
    records.append({"graph": index, "wall_s": time.perf_counter() - started})
    return records


#: engine steps between the starts of two graphs in the ``stream`` phase
STAGGER = 4


def stream_graphs(driver, requests, reply_tokens: int) -> dict:
    """``requests``' graphs served at once on ``driver``'s engine as independent users send them:
    a graph's next agent is submitted as soon as its predecessor's reply is out, graph ``g``'s
    first agent ``g * STAGGER`` steps after the first graph's. Returns the set's wall time and
    each graph's."""
    from vllm import SamplingParams

    engine = driver.llm.llm_engine
    replies = [[] for _ in requests]
    live, begun, ended = {}, {}, {}

    def submit(g: int) -> None:
        k, request = len(replies[g]), requests[g]
        ids = driver.ids(request.messages(k, replies[g]))
        params = SamplingParams(max_tokens=reply_tokens, temperature=0,
                                extra_args={"kv_transfer_params": {"agent": request.agents[k]}})
        key = f"stream-{g}-{k}"
        given = engine.add_request(key, {"prompt_token_ids": ids}, params)
        live[key] = g
        if given is not None and given != key:  # vLLM may suffix the id; outputs carry one or the other
            live[given] = g

    started, step, next_graph = time.perf_counter(), 0, 0
    while len(ended) < len(requests):
        if next_graph < len(requests) and step >= next_graph * STAGGER:
            begun[next_graph] = time.perf_counter()
            submit(next_graph)
            next_graph += 1
        for out in engine.step():
            if not out.finished or out.request_id not in live:
                continue
            g = live.pop(out.request_id)
            replies[g].append(out.outputs[0].text)
            if len(replies[g]) < len(requests[g].agents):
                submit(g)
            else:
                ended[g] = time.perf_counter()
        step += 1
    return {"graphs": len(requests), "wall_s": time.perf_counter() - started,
            "graph_s": [ended[g] - begun[g] for g in range(len(requests))]}
