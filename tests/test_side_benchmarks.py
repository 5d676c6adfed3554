"""The side benchmarks on a tiny model, each on its own: offset sources and learned predictors,
framed decode, the vLLM benchmark's turn-taking (a stub child per strategy), parallel branches
through LangGraph, short re-rotation samples and batched decode steps. Only what must hold
whatever the timings."""

import json

import pytest

from .test_workloads import needs_data


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



def test_offset_sources_scores_other_receivers_anchors_as_the_estimate(tmp_path):
    """``--transfer`` (issue 32's "offsets that transfer"): wherever other receivers hold other
    anchors of a kind at least as long, ``others' mean`` is scored, and ``all receivers' mean``
    where the receiver holds some too; the changing graph (g) is among the workloads. A reply's
    own records from another receiver stay the closest source there."""
    import math

    from benchmarks import offset_sources

    results = offset_sources.main(["--model", "random:tiny", "--workloads", "b,g", "--requests", "3,3", "--transfer",
                                   "--out", str(tmp_path / "sources.json")])
    replies = [r["error"] for r in results["b"] if r["kind"] == ["solver-1", "assistant"]]
    assert replies and all({"others' mean|keys", "others' mean|values", "all receivers' mean|keys"} <= e.keys()
                           for e in replies)
    assert all(v >= 0 and math.isfinite(v) for rows in results.values() for r in rows for v in r["error"].values())
    assert any("others' mean|keys" in r["error"] for r in results["g"])
    for e in replies:
        closest = min(v for k, v in e.items() if k.startswith("from ") and k.endswith("|keys"))
        assert closest < e["others' mean|keys"]

def test_framed_decode_times_whole_pipelines_with_and_without_copies(tmp_path):
    """``benchmarks.framed_decode`` answers the same messages on both engines and reports each
    engine's copies (whether the framed engine feeds any on this tiny random model depends on what its
    readers' plans computed: tests/test_text_framing.py checks the copies themselves)."""
    from benchmarks import framed_decode

    result = framed_decode.main(["--model", "random:tiny", "--device", "cpu", "--requests", "2", "--tokens", "8",
                                 "--workloads", "a", "--out", str(tmp_path)])
    records = result["workloads"]["a"]["records"]
    assert {r["request"] for r in records} == {1}  # the warm-up request is left out
    assert all("copies" in r["framed"] for r in records)
    assert not any(r["unframed"]["copies"] for r in records)
    summary = result["workloads"]["a"]["summary"]
    assert summary["pipelines"] == 1 and summary["wall_unframed_over_framed"] > 0
    assert json.loads(next(tmp_path.glob("*.json")).read_text())["workloads"]["a"]["summary"] == summary


STUB_CHILD = r"""
import json, sys, time
strategy = sys.argv[1]
print("vLLM-like log line", flush=True)
print("READY", flush=True)
for line in sys.stdin:
    started = time.perf_counter()
    time.sleep(0.02)
    print("RESULT " + json.dumps([{"graph": int(line), "agent_index": 1, "prompt_tokens": 4, "reused_tokens": 0,
                                   "ttft_s": 0.01, "strategy": strategy, "started": started},
                                  {"graph": int(line), "wall_s": time.perf_counter() - started, "started": started,
                                   "ended": time.perf_counter()}]), flush=True)
"""


def test_vllm_strategies_take_turns_graph_by_graph_never_at_once(tmp_path):
    """The vLLM benchmark's ttft phase: one child per strategy, each graph run by every child in
    turn (the order rotated per graph), never two at once, each strategy's records its own."""
    import sys
    from types import SimpleNamespace

    from benchmarks.vllm_serving import summarize
    from benchmarks.vllm_turns import interleaved_ttft

    script = tmp_path / "child.py"
    script.write_text(STUB_CHILD)
    strategies = ["vllm-apc", "connector", "connector-replies"]
    results = interleaved_ttft(strategies, SimpleNamespace(requests=4), tmp_path,
                               command=lambda strategy: [sys.executable, str(script), strategy])
    assert [r["strategy"] for r in results] == strategies
    walls = sorted((r["started"], r["ended"], result["strategy"], r["graph"]) for result in results
                   for r in result["records"] if "wall_s" in r)
    assert all(earlier[1] <= later[0] for earlier, later in zip(walls, walls[1:]))  # never two at once
    for graph in range(4):  # each graph by every strategy, the first turn rotating
        turn = [strategy for _, _, strategy, g in walls if g == graph]
        assert turn == strategies[graph % 3:] + strategies[:graph % 3]
    for result in results:
        assert {r["strategy"] for r in result["records"] if "strategy" in r} == {result["strategy"]}
    table = summarize(results, warmup=1)
    assert set(table["ttft"]) == set(strategies) and table["ttft"]["vllm-apc"]["graph_speedup_vs_vllm"] == 1.0


def test_parallel_branches_charge_every_forward_and_siblings_compute_the_document_once(llama, tokenizer):
    from benchmarks import parallel_branches as pb
    from benchmarks.graph import ModelMeter

    meter = ModelMeter(llama)
    try:
        strategies = [pb._strategy(n, llama, tokenizer) for n in ("dense", "kvcomm-mean-no-siblings", "kvcomm-mean")]
        records = pb.run("map", strategies, pb.inputs("dev", 1), warmup=0, reply_tokens=3, meter=meter,
                         progress=lambda line: None)
    finally:
        meter.close()
    by = {r["strategy"]: r for r in records}
    assert by["dense"]["reused_tokens"] == 0 and by["kvcomm-mean-no-siblings"]["reused_tokens"] < by["kvcomm-mean"]["reused_tokens"]
    # the branches' shared beginning is forwarded once under the default, four times otherwise
    assert by["kvcomm-mean"]["tokens"] < 0.5 * by["kvcomm-mean-no-siblings"]["tokens"]
    assert by["kvcomm-mean-no-siblings"]["tokens"] > 0.9 * by["dense"]["tokens"]
    assert max(by["kvcomm-mean"]["branch_kl"]) < 1e-6 and len(by["kvcomm-mean"]["branch_kl"]) >= 4  # exact prefixes
    assert pb._batcher(strategies[2]) is not None and pb._batcher(strategies[0]) is None  # dense: steps alone
    assert by["dense"]["missed_windows"] == 0
    summary = pb.summarize(records)
    assert "| map | kvcomm-mean |" in pb.table(summary)
    assert {row["strategy"]: row["missed_windows"] for row in summary}["kvcomm-mean"] == by["kvcomm-mean"]["missed_windows"]


def test_short_samples_measure_the_cut_prompt_beside_the_whole_one(tmp_path):
    """``benchmarks/short_samples.py`` on the tiny model: each reader of (h)'s document gets the
    whole check and a sample on its prompt cut to 128 ids of the document, far fewer ids."""
    from benchmarks import short_samples

    rows = short_samples.main(["--model", "random:tiny", "--phases", "h", "--requests", "1", "--lengths", "128",
                               "--out", str(tmp_path / "short.json")])
    assert len(rows) == 3 and json.loads((tmp_path / "short.json").read_text())
    for row in rows:
        short = row["short_128"]
        assert row["kl"] > 0 and short["kl"] > 0
        assert max(row["runs"]) > 1000 and short["ids"] < row["ids"] // 3


def test_nearest_version_reads_an_exact_version_as_dense_and_the_others_apart(tmp_path):
    """``benchmarks/nearest_version.py`` on the tiny model: a version computed after the reader's
    own ids, re-rotated into place, gives dense's first token (the frames line up); versions after
    a foreign prefix and the base do not."""
    from benchmarks import nearest_version

    rows = nearest_version.main(["--model", "random:tiny", "--phases", "h", "--requests", "1",
                                 "--out", str(tmp_path / "nearest.json")])
    assert rows and json.loads((tmp_path / "nearest.json").read_text())
    for row in rows:
        for head in ("0", "16"):
            assert row["kl"]["exact"][head] < 1e-5  # float error only
            assert row["kl"]["k=0"][head] > max(50 * row["kl"]["exact"][head], 1e-5)


def test_batched_steps_times_a_forward_per_length_and_rows(tmp_path):
    """``benchmarks.batched_steps`` on a tiny model: one record per (length, rows, ids per row),
    per row the forward divided by the rows, a table and the JSON."""
    from benchmarks import batched_steps

    out = tmp_path / "steps.json"
    batched_steps.main(["--model", "random:tiny", "--lengths", "8,16", "--rows", "1,3", "--ids", "1,4", "--steps", "2",
                        "--out", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [(r["cached"], r["rows"], r["ids"]) for r in records] == [
        (length, rows, ids) for length in (8, 16) for rows in (1, 3) for ids in (1, 4)]
    assert all(r["step_s"] > 0 and r["per_row_s"] * r["rows"] == pytest.approx(r["step_s"]) for r in records)
    assert "| 16 | 3 | 4 |" in batched_steps.table(records)


def test_batched_steps_compares_the_weight_layouts_on_one_model(tmp_path):
    """``--layouts as_loaded,transposed``: every record once per layout, and the second's
    forward over the first's per (length, rows, ids)."""
    from benchmarks import batched_steps

    out = tmp_path / "steps.json"
    batched_steps.main(["--model", "random:tiny", "--lengths", "8", "--rows", "1", "--ids", "1,3", "--steps", "2",
                        "--layouts", "as_loaded,transposed", "--out", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [(r["layout"], r["ids"]) for r in records] == [
        ("as_loaded", 1), ("as_loaded", 3), ("transposed", 1), ("transposed", 3)]
    assert all(r["prefill_s"] > 0 for r in records)
    table = batched_steps.pair_table(records, "layout", "as_loaded", "transposed").splitlines()
    assert len(table) == 4 and table[2].startswith("| 8 | 1 | 1 |")


def test_batched_steps_compares_kv_concatenated_and_written_in_place(tmp_path):
    """``--kv concatenated,in_place``: every record once per way of adding a step's KV."""
    from benchmarks import batched_steps

    out = tmp_path / "steps.json"
    batched_steps.main(["--model", "random:tiny", "--lengths", "8,16", "--rows", "2", "--steps", "2",
                        "--kv", "concatenated,in_place", "--out", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [(r["kv"], r["cached"]) for r in records] == [  # in turn per length
        ("concatenated", 8), ("in_place", 8), ("concatenated", 16), ("in_place", 16)]
    table = batched_steps.pair_table(records, "kv", "concatenated", "in_place").splitlines()
    assert len(table) == 4 and table[3].startswith("| 16 | 2 | 1 |")


def test_draft_policies_replay_a_reply_under_each_length_rule():
    """``benchmarks.draft_policies.replay`` on a reply that repeats its prompt: no drafts take
    one forward per id; every policy, where longer forwards cost little more, takes no longer;
    the oracle's time is the least; a draft found in a recent reply counts."""
    from benchmarks import draft_policies

    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    reply = [5, 6, 7, 8, 9, 10, 11, 40, 41, 42]
    call = {"ids": prompt + reply, "start": len(prompt) + 1, "recent": []}
    costs = {q: 0.04 + 0.005 * (q - 1) for q in range(1, 10)}  # longer forwards cost a little more
    none = draft_policies.replay(call, 8, costs, "none")
    assert none[1] == len(reply) - 1 and none[2] == len(reply) - 1  # one forward, one id, per pick
    times = {name: draft_policies.replay(call, 8, costs, draft_policies.POLICIES.get(name, name))
             for name in ["none", *draft_policies.POLICIES, "oracle"]}
    assert all(seconds <= none[0] for seconds, _, _ in times.values())
    assert times["oracle"][0] == min(seconds for seconds, _, _ in times.values())
    assert times["oracle"][1] < none[1]
    from_recent = {"ids": [1, 2, 3, 4, 20, 21, 22, 23, 24, 25], "start": 5, "recent": [[3, 4, 20, 21, 22, 23, 24, 25]]}
    assert draft_policies.replay(from_recent, 8, costs, "oracle")[1] < draft_policies.replay(from_recent, 8, costs, "none")[1]


@needs_data
def test_held_out_shapes_embed_their_shared_texts_and_run_the_graph_protocol(tmp_path):
    """``benchmarks/held_out_shapes.py``: every shared text is held verbatim by a reader's prompt
    and every reader's prompt holds one (``excerpts`` gives each reader its own window of the
    page), the splits' data differ, and a tool graph runs on the tiny model with every
    strategy's graph summarized and written."""
    from benchmarks import held_out_shapes as hs

    for shape in hs.SHAPES:
        probed, unseen = (hs.workload(shape, split, 2) for split in ("probed", "unseen"))
        assert probed.requests[0].key != unseen.requests[0].key
        for request in unseen.requests:
            replies = [f"reply {k} of {request.key}" for k in range(len(request.agents))]
            prompts = ["".join(m["content"] for m in request.messages(k, replies[:k]))
                       for k in range(1, len(request.agents))]
            assert all(any(text in prompt for prompt in prompts) for text in request.shared), (shape, request.key)
            for k, prompt in enumerate(prompts, start=1):
                assert any(text in prompt for text in request.shared_texts(k, replies[:k])), (shape, k)
    results = hs.main(["--model", "random:tiny", "--shapes", "tool", "--requests", "2", "--reply-tokens", "4",
                       "--strategies", "dense,kvcomm-mean", "--out", str(tmp_path)])
    rows = {row["strategy"]: row for row in results["phases"]["tool"]["graphs"]}
    assert set(rows) == {"dense", "kvcomm-mean"} and rows["kvcomm-mean"]["tokens_mean"] > 0
    written = json.loads((tmp_path / "held_out_shapes-unseen.json").read_text())
    assert written["split"] == "unseen"
    from benchmarks.tables import render

    table = render(written)
    assert "unseen split" in table and "#### (tool)" in table and "| **default** |" in table
