"""Smoke run of ``python -m benchmarks`` on a tiny model: every phase, every strategy, a few calls.

Checks what must hold whatever the timings: the table, JSON and plots exist; every strategy ran
on identical prompts; the exact strategies are exact; reuse strategies reuse; resuming loads
finished phases instead of rerunning them. No timing is asserted.
"""

import json

import pytest

from benchmarks import run
from benchmarks.strategies import DEFAULT_NAMES, NAMES
from benchmarks.workloads import (
    coding_pipeline, gsm8k_debate, gsm8k_one_message, paper_shape, rag_handoff, shared_history,
)
from kvcomm_agents.prompt import render_prompt


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    results = run.main(["--profile", "smoke", "--model", "random:tiny", "--device", "cpu", "--out", str(out),
                        "--strategies", ",".join(NAMES)])
    folder = out / "random-tiny" / "smoke"
    saved = {phase: json.loads((folder / f"phase_{phase}.json").read_text()) for phase in run.PHASES if phase != "b-gamma"}
    records = [r for phase in saved.values() for r in phase["records"]]
    return results, records, folder, out, saved


def test_every_phase_and_strategy_is_reported(smoke):
    results, records, folder, _, saved_phases = smoke
    assert set(results["phases"]) == set(run.PHASES)
    for phase in ("a", "b", "c", "d", "e", "f"):
        assert {r["strategy"] for r in records if r["phase"] == phase} >= set(NAMES)
    # end to end: dense is the cached dense pipeline, not decoded again
    assert {r["strategy"] for r in records if r["phase"] == "b-e2e"} == set(run.E2E_STRATEGIES) - {"dense"}
    assert {a["strategy"] for a in results["phases"]["b-e2e"]["answers"]} == set(run.E2E_STRATEGIES)
    assert results["phases"]["b-e2e"]["concurrent"]  # on a CPU the pipelines run side by side
    assert all(r["concurrent"] for r in records if r["phase"] == "b-e2e")
    assert any(r["strategy"].startswith("noise-floor") for r in records if r["phase"] == "b")
    assert not (folder / "phase_b-gamma.json").exists()  # read from phase b, where it ran alongside
    gamma_rows = {r["strategy"] for r in results["rows"] if r["phase"] == "b-gamma"}
    assert gamma_rows == {"dense", "rerotate", "kvcomm-mean(gamma=0.1)", "kvcomm-mean(gamma=0.3)"}
    # measured on (b)'s first questions only: warm-up 1 + gamma 1, and the noise floor on measured
    # question 1 (after one call on the last warm-up question)
    b = saved_phases["b"]
    assert {r["request"] for r in b["gamma_records"]} == {0, 1}
    assert {r["request"] for r in b["records"] if r["strategy"].startswith("noise-floor")} == {0, 1}
    assert {r["request"] for r in b["records"] if r["strategy"] == "dense"} == {0, 1, 2}
    saved = json.loads((folder / "results.json").read_text())
    assert saved["versions"]["torch"] and saved["rows"]
    assert {p.split("/")[-1] for p in saved["plots"]} == {
        "ttft_by_agent_a.png", "ttft_by_agent_b.png", "ttft_by_agent_c.png", "ttft_by_agent_d.png",
        "ttft_by_agent_e.png", "ttft_by_agent_f.png", "speedup_vs_prompt_length.png", "kl_vs_reuse_gamma.png"}
    assert all((folder / "plots" / name).stat().st_size > 1000 for name in ("kl_vs_reuse_gamma.png",))
    from benchmarks.report import _label, markdown

    text = markdown(saved)  # the tables of docs/benchmarks.md
    for phase in ("a", "b", "c", "d", "e", "f"):
        assert all(f"| {_label(name)} |" in text for name in NAMES), phase
    assert "| KVCOMM mean, γ=0.1 |" in text and "final answer = dense pipeline's" in text


def test_strategies_see_identical_prompts_and_the_exact_ones_are_exact(smoke):
    _, records, _, _, _ = smoke
    forced = [r for r in records if r["phase"] in ("a", "b", "c", "d", "e", "f")]
    by_slot = {}
    for r in forced:
        by_slot.setdefault((r["phase"], r["request"], r["agent_index"]), set()).add(r["prompt_tokens"])
    assert all(len(lengths) == 1 for lengths in by_slot.values())
    for r in forced:
        if r["strategy"] in ("dense", "prefix", "lower-bound"):
            assert r["kl"] < 1e-4, r  # exact: dense on its own, an exact prefix, the exact cache
        if r["strategy"] == "dense":
            assert r["reused_tokens"] == 0 and r["agree"]
            assert 0 <= r["greedy_prefix"] <= r["forced_tokens"]  # forced the whole reply
        if r["strategy"] == "prefix":
            assert set(r["prefilled_reasons"]) <= {"exact_only"}


def test_reuse_strategies_reuse_downstream(smoke):
    _, records, _, _, _ = smoke
    downstream = [r for r in records if r["phase"] in ("a", "b") and r["agent_index"] > 1 and not r["warmup"]]
    for name in ("rerotate", "cacheblend"):
        mine = [r for r in downstream if r["strategy"] == name]
        assert mine and all(r["reused_tokens"] > 0 and r["fully_reused"] for r in mine)
    blend = [r for r in downstream if r["strategy"] == "cacheblend"]
    assert all(r["recomputed_tokens"] > 0 for r in blend)
    reuse = {r["strategy"]: r["reused_tokens"] for r in downstream if r["request"] == downstream[-1]["request"]}
    assert reuse["rerotate"] > reuse["cacheblend"] > reuse["dense"] == 0


def test_one_message_prompts_reuse_the_task_by_token_runs(smoke):
    """(e): the task embedded in each solver's one user message is found only by token runs."""
    _, records, _, _, _ = smoke
    downstream = [r for r in records if r["phase"] == "e" and r["agent_index"] > 1]
    reused = {name: sum(r["reused_tokens"] for r in downstream if r["strategy"] == name)
              for name in ("rerotate", "rerotate-messages")}
    assert reused["rerotate"] > reused["rerotate-messages"]


def test_the_task_and_replies_share_is_measured_per_call(smoke):
    """(e): every downstream call maps the task and the earlier replies to prompt tokens; dense
    serves none of them from cache, the lower bound all, token runs more than whole messages."""
    _, records, _, _, saved = smoke
    downstream = [r for r in records if r["phase"] == "e" and r["agent_index"] > 1]
    assert downstream and all(r["shared_text_tokens"] and 0 <= r["shared_text_reused"] <= r["shared_text_tokens"]
                              for r in downstream)
    share = {name: sum(r["shared_text_reused"] for r in downstream if r["strategy"] == name)
             for name in ("dense", "lower-bound", "rerotate", "rerotate-messages")}
    assert share["dense"] == 0
    assert share["lower-bound"] == sum(r["shared_text_tokens"] for r in downstream if r["strategy"] == "lower-bound")
    assert share["rerotate"] > share["rerotate-messages"]


def test_a_finished_phase_is_loaded_not_rerun(smoke, capsys):
    _, _, folder, out, _ = smoke
    before = (folder / "phase_b.json").stat().st_mtime_ns
    run.main(["--profile", "smoke", "--model", "random:tiny", "--device", "cpu", "--out", str(out), "--phases", "b",
              "--strategies", ",".join(NAMES),
              "--no-plots"])
    assert "phase b: finished earlier" in capsys.readouterr().out
    assert (folder / "phase_b.json").stat().st_mtime_ns == before


def test_workloads_have_the_declared_shape():
    from kvcomm_agents.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    a = paper_shape(tokenizer, requests=2, agents=3, lead_tokens=30, input_tokens=60, reply_tokens=8)
    messages = a.requests[1].messages(2, ["one", "two"])
    assert [m["role"] for m in messages] == ["system", "user", "user", "user"]
    assert len(tokenizer(messages[0]["content"])["input_ids"]) <= 30
    assert 50 <= len(tokenizer(messages[1]["content"])["input_ids"]) <= 60
    assert a.requests[0].messages(2, [])[0] == messages[0]  # own leading text: the same in every request
    assert a.requests[0].messages(0, [])[1] != messages[1]  # shared input: different per request
    for workload in (gsm8k_debate(requests=2), rag_handoff(requests=2), coding_pipeline(requests=2),
                     gsm8k_one_message(requests=2), shared_history(requests=2)):
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


@pytest.mark.model
def test_shipped_replies_are_taken_for_their_keys_only(tmp_path):
    import torch

    from benchmarks import measure
    from benchmarks.models import load

    loaded = load("random:tiny", device="cpu", dtype=torch.float32)
    workload = gsm8k_debate(requests=2, agents=2, reply_tokens=4)
    run._fingerprint(workload)
    generated = measure.references(workload, loaded.model, loaded.tokenizer, tmp_path / "first.pt")
    shipped_key = workload.requests[0].key
    seed = tmp_path / "seed.json"  # a marker text shows which source a reply came from
    seed.write_text(json.dumps({shipped_key: [{"ids": [1], "text": "shipped"}] * 2, "other-prompt": []}))
    refs = measure.references(workload, loaded.model, loaded.tokenizer, tmp_path / "second.pt", seed=seed)
    assert refs[shipped_key][0]["text"] == "shipped"
    other = workload.requests[1].key
    assert refs[other] == generated[other]  # no seed for this prompt: generated


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


def test_timed_end_to_end_reports_each_pipelines_wall_time(tmp_path):
    results = run.main(["--profile", "smoke", "--model", "random:tiny", "--device", "cpu", "--out", str(tmp_path),
                        "--phases", "b-e2e", "--e2e-timed", "--no-plots"])
    phase = results["phases"]["b-e2e"]
    assert not phase["concurrent"]
    walls = phase["pipeline_wall"]
    assert set(walls) == set(run.E2E_STRATEGIES) & set(DEFAULT_NAMES)
    assert all(w["median_s"] > 0 and w["requests"] >= 1 for w in walls.values())
    assert walls["dense"]["speedup_vs_dense"] == 1.0


def test_offset_sources_scores_each_receivers_recorded_offsets(tmp_path):
    """``benchmarks.offset_sources`` on a tiny model: every reply kind read by two or more
    receivers is scored from the other receivers' records, errors are relative (>= 0), the
    JSON is written."""
    from benchmarks import offset_sources

    out = tmp_path / "sources.json"
    results = offset_sources.main(["--model", "random:tiny", "--workloads", "b", "--requests", "2", "--out", str(out)])
    rows = results["b"]
    replies = [r for r in rows if r["kind"] == ["solver-1", "assistant"]]
    assert {r["receiver"] for r in replies} == {"solver-2", "solver-3", "solver-4"}
    assert all(any(k.startswith("from ") for k in r["error"]) for r in replies)
    assert all(v >= 0 for r in rows for v in r["error"].values())
    assert json.loads(out.read_text()) == results


def test_offset_sources_scores_the_learned_predictors(tmp_path):
    """``--regression`` adds the ridge and probe predictors wherever a receiver holds three or
    more anchors of a kind; their errors are relative (>= 0) and finite."""
    import math

    from benchmarks import offset_sources

    results = offset_sources.main(["--model", "random:tiny", "--workloads", "b", "--requests", "4", "--regression",
                                   "--out", str(tmp_path / "sources.json")])
    learned = [r["error"] for r in results["b"] if r["anchors"] >= 3]
    assert learned and all({f"{s}|{p}" for s in ("ridge", "ridge@2", "probe1") for p in ("keys", "values")} <= e.keys()
                           for e in learned)
    assert all(v >= 0 and math.isfinite(v) for e in learned for v in e.values())


def test_the_hand_off_charges_the_senders_framing_work_to_the_next_agent(smoke):
    """``handoff_s``: a call's TTFT plus what the previous agent's call (same request, same
    strategy) spent after its reply on framed copies; ``kvcomm-unframed`` and the baselines spend none
    (whether the smoke profile's few requests teach it a framing is tests/test_framing.py's concern)."""
    _, records, _, _, _ = smoke
    forced = [r for r in records if "handoff_s" in r]
    assert forced
    by_slot = {(r["phase"], r["request"], r["strategy"], r["agent_index"]): r for r in forced}
    for r in forced:
        before = by_slot.get((r["phase"], r["request"], r["strategy"], r["agent_index"] - 1))
        spent = before["framed_s"] if before is not None and before.get("framed_s") else 0.0
        assert r["handoff_s"] == pytest.approx(r["ttft_s"] + spent)
        if r["strategy"] == "kvcomm-unframed" or not r["strategy"].startswith("kvcomm"):
            assert not r.get("framed_versions")


def test_framed_decode_times_whole_pipelines_with_and_without_copies(tmp_path):
    """``benchmarks.framed_decode`` answers the same messages on both engines, and the default
    engine's first agents feed copies (a: the shared input for the later agents)."""
    from benchmarks import framed_decode

    result = framed_decode.main(["--model", "random:tiny", "--device", "cpu", "--requests", "2", "--tokens", "8",
                                 "--workloads", "a", "--out", str(tmp_path)])
    records = result["workloads"]["a"]["records"]
    assert {r["request"] for r in records} == {1}  # the warm-up request is left out
    assert any(r["default"]["copies"] for r in records if r["agent_index"] == 0)
    assert not any(r["unframed"]["copies"] for r in records)
    summary = result["workloads"]["a"]["summary"]
    assert summary["pipelines"] == 1 and summary["wall_unframed_over_default"] > 0
    assert json.loads(next(tmp_path.glob("*.json")).read_text())["workloads"]["a"]["summary"] == summary
