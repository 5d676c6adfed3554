"""Smoke run of ``python -m benchmarks`` on a tiny model: every phase, every strategy, a few calls.

Checks what must hold whatever the timings: the tables, JSON, summary and plots exist; every
strategy ran on identical prompts; the exact strategies are exact; reuse strategies reuse; every
graph is charged what the model forwarded for it; resuming loads a finished phase only when its
signature is unchanged. No timing is asserted.
"""

import copy
import json

import pytest
import torch

from benchmarks import run
from benchmarks.graph_tables import front_table, workload_tables
from benchmarks.tables import render
from benchmarks.strategies import DEFAULT_NAMES, NAMES
from benchmarks.workloads import (
    coding_pipeline, gsm8k_debate, gsm8k_one_message, paper_shape, rag_handoff, shared_history,
)
from kvcomm_agents.prompt import render_prompt

# the layout pinned: a tiny model's probe is noise, and a phase's signature holds the layout
SMOKE = ["--profile", "smoke", "--model", "random:tiny", "--device", "cpu", "--split", "dev", "--weight-layout", "as_loaded"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    summary = out / "summary.json"
    results = run.main(SMOKE + ["--out", str(out), "--phases", ",".join(run.PHASES), "--strategies", ",".join(NAMES),
                                "--summary", str(summary), "--remembered", str(out / "remembered")])
    folder = out / "random-tiny" / "smoke" / "dev"
    saved = {phase: json.loads((folder / f"phase_{phase}.json").read_text()) for phase in run.PHASES}
    records = [r for phase in saved.values() for r in phase["records"]]
    return results, records, folder, out, json.loads(summary.read_text())


def test_every_phase_and_strategy_is_reported(smoke):
    results, records, folder, _, summary = smoke
    assert set(results["phases"]) == set(run.PHASES)
    for phase in run.GRAPH_PHASES:
        assert {r["strategy"] for r in records if r["phase"] == phase} == set(NAMES), phase
        assert {row["strategy"] for row in results["phases"][phase]["graphs"]} == set(NAMES), phase
    for phase in run.DECIDING_PHASES:  # the last agent decides: its pick under each strategy
        assert {row["strategy"] for row in results["phases"][phase]["decisions"]} == set(NAMES) - {"lower-bound"}
    # end to end: the dense pipeline is run in the same run, side by side on a CPU
    assert {r["strategy"] for r in records if r["phase"] == "b-e2e"} == set(run.E2E_STRATEGIES)
    assert {a["strategy"] for a in results["phases"]["b-e2e"]["answers"]} == set(run.E2E_STRATEGIES)
    assert results["phases"]["b-e2e"]["concurrent"]
    saved = json.loads((folder / "results.json").read_text())
    assert saved["versions"]["torch"] and saved["versions"]["commit"] and saved["rows"]
    # the host: one CPU name covers hosts whose kernels differ twofold (AVX2 against AVX512)
    assert saved["versions"]["cpu"].endswith(", " + torch.backends.cpu.get_cpu_capability())
    assert f"cpu: {saved['versions']['cpu']} (" in render(summary)
    assert {p.split("/")[-1] for p in saved["plots"]} == (
        {f"ttft_by_agent_{p}.png" for p in run.GRAPH_PHASES} | {"graph_speedup_by_workload.png"})
    # the summary the docs quote: no per-call records, every phase's whole-graph rows
    assert "records" not in json.dumps(summary) and set(summary["phases"]) == set(run.PHASES)
    table = front_table(summary)
    assert all(f"| ({p}) " in table for p in run.GRAPH_PHASES)
    assert "#### (i)" in workload_tables(summary) and "picks as under dense" in workload_tables(summary)


def test_strategies_see_identical_prompts_and_the_exact_ones_are_exact(smoke):
    _, records, _, _, _ = smoke
    graph = [r for r in records if r["phase"] in run.GRAPH_PHASES and not r["warmup"]]
    by_slot = {}
    for r in graph:
        by_slot.setdefault((r["phase"], r["request"], r["agent_index"]), set()).add(r["prompt_tokens"])
    assert all(len(lengths) == 1 for lengths in by_slot.values())
    for r in graph:
        if r["strategy"] in ("dense", "prefix", "pipelined", "lower-bound"):
            assert r["kl"] < 1e-4, r  # exact: dense on its own, exact prefixes, the exact cache
        if r["strategy"] == "dense":
            assert r["reused_tokens"] == 0 and r["greedy_prefix"] == r["forced_tokens"]  # its own greedy reply
        if r["strategy"] == "prefix":
            assert set(r["prefilled_reasons"]) <= {"exact_only"}


def test_every_graph_is_charged_what_the_model_forwarded_for_it(smoke):
    """Engine strategies: the hook on the model counts what the engine itemizes (prompt, decode,
    copies, audits); pipelined prefill more (what it computed ahead for its readers); the lower
    bound less than dense (shared text's prefill removed)."""
    _, records, _, _, _ = smoke
    graph = [r for r in records if r["phase"] in run.GRAPH_PHASES and not r["warmup"]]
    for r in graph:
        if r["forwarded"] is not None and r["strategy"] != "pipelined":
            assert r["model_tokens"] == sum(r["forwarded"].values()), r
    senders = [r for r in graph if r["strategy"] == "pipelined" and r["agent_index"] == 1]
    assert any(r["model_tokens"] > sum(r["forwarded"].values()) for r in senders)


def test_reuse_strategies_reuse_downstream(smoke):
    _, records, _, _, _ = smoke
    downstream = [r for r in records if r["phase"] in ("a", "b") and r["agent_index"] > 1 and not r["warmup"]]
    for name in ("rerotate", "cacheblend"):
        mine = [r for r in downstream if r["strategy"] == name]
        assert mine and all(r["reused_tokens"] > 0 for r in mine)
    blend = [r for r in downstream if r["strategy"] == "cacheblend"]
    assert any(r["recomputed_tokens"] > 0 for r in blend)


def test_one_message_prompts_reuse_the_task_by_token_runs(smoke):
    """(e): the task embedded in each solver's one user message is found only by token runs."""
    _, records, _, _, _ = smoke
    downstream = [r for r in records if r["phase"] == "e" and r["agent_index"] > 1]
    reused = {name: sum(r["reused_tokens"] for r in downstream if r["strategy"] == name)
              for name in ("rerotate", "rerotate-messages")}
    assert reused["rerotate"] > reused["rerotate-messages"]


def test_the_task_and_replies_share_is_measured_per_call(smoke):
    """(e): every downstream call maps the task and the earlier replies to prompt tokens; dense
    serves none of them from cache, the lower bound all."""
    _, records, _, _, _ = smoke
    downstream = [r for r in records if r["phase"] == "e" and r["agent_index"] > 1]
    assert downstream and all(r["shared_text_tokens"] and 0 <= r["shared_text_reused"] <= r["shared_text_tokens"]
                              for r in downstream)
    share = {name: sum(r["shared_text_reused"] for r in downstream if r["strategy"] == name)
             for name in ("dense", "lower-bound")}
    assert share["dense"] == 0
    assert share["lower-bound"] == sum(r["shared_text_tokens"] for r in downstream if r["strategy"] == "lower-bound")


def test_a_finished_phase_is_loaded_only_when_its_signature_is_unchanged(smoke, capsys):
    _, _, folder, out, _ = smoke
    before = (folder / "phase_b.json").stat().st_mtime_ns
    run.main(SMOKE + ["--out", str(out), "--phases", "b", "--strategies", ",".join(NAMES), "--no-plots",
                      "--remembered", str(out / "remembered")])
    assert "phase b: finished earlier" in capsys.readouterr().out
    assert (folder / "phase_b.json").stat().st_mtime_ns == before
    run.main(SMOKE + ["--out", str(out), "--phases", "b", "--strategies", "dense,rerotate", "--no-plots"])
    assert "phase b: finished earlier" not in capsys.readouterr().out  # other strategies: another signature


def test_only_the_remembering_strategy_remembers_and_it_needs_its_folder(llama, tokenizer, tmp_path):
    """A benchmark run does not depend on what ran before it: every engine strategy but
    ``kvcomm-remembered`` passes ``remember_measurements=False``; that one needs ``--remembered``."""
    from benchmarks.strategies import build

    with pytest.raises(SystemExit):
        run.parse_args(["--strategies", "dense,kvcomm-remembered"])
    with pytest.raises(ValueError, match="--remembered"):
        build("kvcomm-remembered", llama, tokenizer)
    assert build("kvcomm-mean", llama, tokenizer, remembered=str(tmp_path)).engine.config.remember_measurements is False
    remembering = build("kvcomm-remembered", llama, tokenizer, remembered=str(tmp_path))
    assert remembering.engine.config.remember_measurements == str(tmp_path)


def test_workloads_have_the_declared_shape():
    from kvcomm_agents.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    a = paper_shape(tokenizer, requests=2, split="dev", agents=3, lead_tokens=30, input_tokens=60, reply_tokens=8)
    messages = a.requests[1].messages(2, ["one", "two"])
    assert [m["role"] for m in messages] == ["system", "user", "user", "user"]
    assert len(tokenizer(messages[0]["content"])["input_ids"]) <= 30
    assert 50 <= len(tokenizer(messages[1]["content"])["input_ids"]) <= 60
    assert a.requests[0].messages(2, [])[0] == messages[0]  # own leading text: the same in every request
    assert a.requests[0].messages(0, [])[1] != messages[1]  # shared input: different per request
    for workload in (gsm8k_debate(requests=2, split="dev"), rag_handoff(requests=2, split="dev"),
                     coding_pipeline(requests=2, split="dev"), gsm8k_one_message(requests=2, split="dev"),
                     shared_history(requests=2, split="dev")):
        request = workload.requests[0]
        k = len(request.agents) - 1
        ids = render_prompt(tokenizer, request.messages(k, ["reply"] * k)).ids
        assert ids.numel() > 20 and len({r.key for r in workload.requests}) == len(workload.requests) >= 1


def test_every_agent_index_sees_every_strategy_first():
    from benchmarks.measure import _rotated

    strategies = [f"s{i}" for i in range(8)]  # 8 strategies, 4 agents: a running call count would give 2 orders
    for k in range(4):
        assert {_rotated(strategies, r + k)[0] for r in range(8)} == set(strategies)
    assert _rotated([], 3) == []


def test_warmup_cost_counts_requests_until_reuse_stays_at_90_percent():
    from benchmarks.report import warmup_cost

    def call(strategy, request, agent_index, fully_reused, shared=True):
        return {"strategy": strategy, "request": request, "agent_index": agent_index, "fully_reused": fully_reused,
                "shared_found": shared, "opted_out": False}

    pattern = {"kvcomm-mean": [False, True, False, True, True], "rerotate": [True] * 5,
               "prefix": [False] * 5}
    records = [call(name, q, k, ok) for name, oks in pattern.items() for q, ok in enumerate(oks) for k in (2, 3)]
    records += [call("kvcomm-mean", q, 1, False) for q in range(5)]  # the first agent never counts
    records += [call("dense", q, 2, False) for q in range(5)]
    assert warmup_cost(records) == {"prefix": None, "rerotate": 1, "kvcomm-mean": 4}


def test_first_request_reports_readers_before_anything_is_learned():
    from benchmarks.report import first_request

    def call(strategy, request, agent_index, ttft, reused):
        return {"strategy": strategy, "request": request, "agent_index": agent_index, "ttft_s": ttft,
                "dense_ttft_s": 1.0, "reused_tokens": reused, "prompt_tokens": 100, "kl": reused / 1000}

    records = [call("dense", q, k, 1.0, 0) for q in (0, 1) for k in (1, 2, 3)]
    records += [call("rerotate", 0, 1, 1.0, 0), call("rerotate", 0, 2, 0.5, 60), call("rerotate", 0, 3, 0.25, 80)]
    records += [call("rerotate", 1, k, 0.1, 90) for k in (2, 3)]  # later requests never count
    records += [call("kvcomm-mean", q, k, 1.0, 0) for q in (0, 1) for k in (2, 3)]
    first = first_request(records)
    assert set(first) == {"rerotate", "kvcomm-mean"}  # dense is the reference
    assert first["rerotate"] == {"reader_ttft_speedup": 3.0, "from_cache": 0.7, "kl": 0.07, "readers": 2}
    assert first["kvcomm-mean"]["reader_ttft_speedup"] == 1.0 and first["kvcomm-mean"]["from_cache"] == 0.0


def test_the_noise_floor_runs_every_named_phases_readers_and_is_no_graph_row(tmp_path):
    from benchmarks.graph_report import noise_floor_readers

    results = run.main(SMOKE + ["--out", str(tmp_path), "--phases", "g,c", "--strategies", "dense,rerotate",
                                "--noise-floor", "g", "--no-plots"])
    phase = json.loads((tmp_path / "random-tiny" / "smoke" / "dev" / "phase_g.json").read_text())
    measured = [r for r in phase["records"] if not r["warmup"]]
    floor = [r for r in measured if r["strategy"].startswith("noise-floor")]
    readers = [r for r in measured if r["strategy"] == "dense" and r["agent_index"] > 1]
    assert readers and len([r for r in floor if r["agent_index"] > 1]) == len(readers)  # every reader, not the last alone
    assert not any(r["strategy"].startswith("noise-floor") for r in phase["records"] if r["warmup"])
    info = results["phases"]["g"]
    assert info["noise_floor"] == noise_floor_readers(phase["records"]) and info["noise_floor"]["every_reader"]
    assert info["noise_floor"]["calls"] == len(readers) and info["noise_floor"]["kl_mean"] is not None
    assert not any(row["strategy"].startswith("noise-floor") for row in info["graphs"])
    assert "the noise floor" in workload_tables({"phases": {"g": info}})
    assert results["phases"]["c"]["noise_floor"] is None  # not named: no floor
    # every request a graph's first (fresh strategies per request): the floor stays for all of them
    cold = run.main(SMOKE + ["--out", str(tmp_path / "cold"), "--phases", "g", "--strategies", "dense",
                             "--noise-floor", "g", "--cold", "--no-plots"])
    records = json.loads((tmp_path / "cold" / "random-tiny" / "smoke" / "dev-cold" / "phase_g.json").read_text())["records"]
    dense_readers = [r for r in records if r["strategy"] == "dense" and r["agent_index"] > 1]
    assert cold["phases"]["g"]["noise_floor"]["calls"] == len(dense_readers) and len({r["request"] for r in dense_readers}) > 1


def test_the_noise_floor_runs_in_another_dtype_than_the_model(llama, tokenizer):
    from benchmarks.strategies import noise_floor

    assert next(noise_floor(llama, tokenizer).engine.model.parameters()).dtype == torch.bfloat16
    bf16 = copy.deepcopy(llama).to(torch.bfloat16)  # the fixture is shared: never cast in place
    assert next(noise_floor(bf16, tokenizer).engine.model.parameters()).dtype == torch.float32


def test_timed_end_to_end_reports_each_pipelines_wall_time(tmp_path):
    results = run.main(SMOKE + ["--out", str(tmp_path), "--phases", "b-e2e", "--e2e-timed", "--no-plots"])
    phase = results["phases"]["b-e2e"]
    assert not phase["concurrent"]
    walls = phase["pipeline_wall"]
    assert set(walls) == set(run.E2E_STRATEGIES) & set(DEFAULT_NAMES) and "dense" in walls
    assert all(w["median_s"] > 0 and w["requests"] >= 1 for w in walls.values())
    assert walls["dense"]["speedup_vs_dense"] == 1.0


def test_the_noise_floor_copies_a_model_its_meter_watched_before(llama, tokenizer):
    """The meter keeps a handle to each noise floor's copy; once a copy is freed, copying the
    model with its hooks on failed (the default profile's second deciding workload)."""
    import gc

    import torch

    from benchmarks.graph import ModelMeter
    from benchmarks.strategies import noise_floor

    meter = ModelMeter(llama)
    try:
        first = noise_floor(llama, tokenizer)
        meter.watch(first.engine.model)
        del first
        gc.collect()
        second = noise_floor(llama, tokenizer)
        assert second.engine.model.dtype == torch.bfloat16
        assert not second.engine.model._forward_pre_hooks  # the copy carries no meter of its own
        before = meter.tokens
        llama(input_ids=torch.tensor([[1, 2, 3]]))
        assert meter.tokens == before + 3  # the model keeps its meter
    finally:
        meter.close()


def test_a_readers_first_token_counts_the_calls_before_it_from_the_graphs_start():
    """Work moved into an earlier agent's turn (a copy) shows in the readers' time from the
    graph's start, not in their TTFT."""
    from benchmarks.graph_report import _first_tokens_from_start, _from_start_speedup

    def call(agent, wall, ttft):
        return {"request": 0, "agent_index": agent, "wall_s": wall, "ttft_s": ttft}

    dense = [call(1, 4.0, 1.0), call(2, 4.0, 1.0), call(3, 4.0, 1.0)]
    moved = [call(1, 6.0, 1.0), call(2, 3.0, 0.2), call(3, 3.0, 0.2)]  # copies in agent 1's turn
    assert _first_tokens_from_start(moved) == pytest.approx({(0, 2): 6.2, (0, 3): 9.2})
    assert _from_start_speedup(dense, moved) == pytest.approx((5 / 6.2 + 9 / 9.2) / 2)


def test_each_agent_index_has_its_readers_kl_and_two_strategies_compare_index_by_index(smoke):
    """The claim "never further from dense than re-rotation only, per agent index" reads from the
    summary a run commits."""
    from benchmarks.graph_report import further_by_agent

    _, records, _, _, summary = smoke
    for phase in run.GRAPH_PHASES:
        row = next(r for r in summary["phases"][phase]["graphs"] if r["strategy"] == "kvcomm-mean")
        mine = [r for r in records if r["phase"] == phase and r["strategy"] == "kvcomm-mean" and not r["warmup"]
                and r["agent_index"] > 1 and r.get("kl") is not None]
        assert set(row["reader_kl_by_agent"]) == {str(r["agent_index"]) for r in mine}, phase
        for index, kl in row["reader_kl_by_agent"].items():
            kls = [r["kl"] for r in mine if str(r["agent_index"]) == index]
            assert kl == pytest.approx(sum(kls) / len(kls)), (phase, index)
    further = further_by_agent(summary)
    assert set(further) == set(run.GRAPH_PHASES)
    assert "Per agent index, the **default**'s readers' mean KL" in workload_tables(summary)


def test_two_strategies_per_agent_index_give_the_largest_excess():
    from benchmarks.graph_report import further_by_agent

    def row(strategy, kls):
        return {"strategy": strategy, "reader_kl_by_agent": kls}

    summary = {"phases": {
        "a": {"graphs": [row("rerotate", {"2": 0.01, "3": 0.02}), row("kvcomm-mean", {"2": 0.0, "3": 0.025})]},
        "b": {"graphs": [row("rerotate", {"2": 0.01}), row("kvcomm-mean", {"2": 0.004})]},
        "c": {"graphs": [row("kvcomm-mean", {"2": 0.004})]},  # no reference: left out
        "d": {"graphs": [{"strategy": "rerotate"}, {"strategy": "kvcomm-mean"}]},  # an older summary
    }}
    assert further_by_agent(summary) == pytest.approx({"a": 0.005, "b": -0.006})


def test_the_tables_command_draws_a_summarys_speed_ups(smoke, tmp_path):
    from benchmarks import tables

    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(smoke[4]))
    image = tmp_path / "speedups.png"
    tables.main([str(summary), "--front", "--plot", str(image), "--strategies", "rerotate,kvcomm-mean"])
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to draw"):
        tables.plot(smoke[4], tmp_path / "none.png", ["no-such-strategy"])
    with pytest.raises(ValueError, match="not a parallel_branches"):
        tables.plot({"kind": "parallel_branches", "rows": []}, tmp_path / "none.png")
    with pytest.raises(SystemExit):  # --strategies alone draws nothing: an error, not silence
        tables.main([str(summary), "--strategies", "rerotate"])
