"""The benchmark's workloads: the dev and report ranges, the texts each agent shares with earlier
ones, and the graphs beyond a fixed pipeline ((b) with a judge, (g), (h), (i), (j)).

Dev split only (the report range is kept for the figures); no model weights.
"""

import pytest

from benchmarks.workloads import (
    DEFAULT_GSM8K, DEFAULT_HUMANEVAL, GSM8K_RANGES, HUMANEVAL_RANGES, LONG_DOCUMENTS, RAG_SPLITS, SPLITS,
    changing_graph, coding_pipeline, fan_out, gsm8k_debate, gsm8k_one_message, long_document, paper_shape,
    prompt_formats, rag_handoff, shared_history,
)
from kvcomm_agents.prompt import render_prompt

needs_data = pytest.mark.skipif(not (DEFAULT_GSM8K.is_file() and DEFAULT_HUMANEVAL.is_file()),
                                reason="without ../shared/data both splits share the built-in rows")


def every_workload(tokenizer, split="dev"):
    """(a)-(i), a few requests each (three of (b): without and with a judge)."""
    return [
        paper_shape(tokenizer, requests=2, split=split, agents=3, lead_tokens=30, input_tokens=60, reply_tokens=8),
        gsm8k_debate(requests=2, split=split), gsm8k_debate(requests=3, split=split, judge=True),
        rag_handoff(requests=2, split=split), coding_pipeline(requests=2, split=split),
        gsm8k_one_message(requests=2, split=split), shared_history(requests=2, split=split),
        changing_graph(requests=4, split=split), long_document(requests=2, split=split),
        fan_out(requests=3, split=split),
    ]


def replies_for(request) -> list[str]:
    """One distinct reply per agent, each ending with a number."""
    return [f"Reply of {name} ({k}): the answer is {100 + k}." for k, name in enumerate(request.agents)]


def prompt_text(tokenizer, request, k: int, replies: list[str]) -> str:
    return render_prompt(tokenizer, request.messages(k, replies[:k])).text


def test_the_ranges_are_declared_and_disjoint():
    assert SPLITS == ("dev", "report")
    assert (GSM8K_RANGES["dev"], GSM8K_RANGES["report"]) == (range(0, 250), range(250, 500))
    assert (HUMANEVAL_RANGES["dev"], HUMANEVAL_RANGES["report"]) == (range(0, 40), range(40, 80))
    assert len(RAG_SPLITS["dev"]) == len(RAG_SPLITS["report"]) == 12
    rag_pages = [{page for entry in RAG_SPLITS[split] for page in entry[:2]} for split in SPLITS]
    assert not rag_pages[0] & rag_pages[1]
    long_pages = [{page for pages, _ in LONG_DOCUMENTS[split] for page in pages} for split in SPLITS]
    assert not long_pages[0] & long_pages[1]


@needs_data
def test_dev_and_report_share_no_question_problem_or_document():
    def tasks(split):
        questions = {r.shared[0] for r in gsm8k_debate(requests=250, split=split).requests}
        problems = {r.key for r in coding_pipeline(requests=40, split=split).requests}
        rag = {r.shared for r in rag_handoff(requests=12, split=split).requests}
        return questions, problems, rag

    dev, report = tasks("dev"), tasks("report")
    assert [len(d) for d in dev] == [250, 40, 12]
    for d, r in zip(dev, report):
        assert not d & r
    assert not ({r.key for r in gsm8k_debate(requests=250, split="dev").requests}
                & {r.key for r in gsm8k_debate(requests=250, split="report").requests})
    with pytest.raises(ValueError, match="outside the dev split"):
        gsm8k_debate(requests=2, split="dev", offset=249)  # would run into the report range


def test_without_the_data_files_both_splits_take_the_built_in_rows(monkeypatch, tmp_path, tokenizer):
    from benchmarks import graphs

    monkeypatch.setattr(graphs, "DEFAULT_GSM8K", tmp_path / "absent.jsonl")
    monkeypatch.setattr(graphs, "DEFAULT_HUMANEVAL", tmp_path / "absent.jsonl")
    for split in SPLITS:
        assert [r.key for r in gsm8k_debate(requests=5, split=split).requests] == ["q0", "q1", "q2"]
        assert [r.key for r in coding_pipeline(requests=2, split=split).requests] == ["builtin_count_vowels"]
        assert len(fan_out(requests=2, split=split, offset=1).requests) == 2
        assert paper_shape(tokenizer, requests=1, split=split, lead_tokens=20, input_tokens=40).requests


@pytest.mark.parametrize("build", [
    lambda split: paper_shape(None, requests=1, split=split), lambda split: gsm8k_debate(requests=1, split=split),
    lambda split: rag_handoff(requests=1, split=split), lambda split: coding_pipeline(requests=1, split=split),
    lambda split: gsm8k_one_message(requests=1, split=split), lambda split: shared_history(requests=1, split=split),
    lambda split: changing_graph(requests=1, split=split), lambda split: long_document(requests=1, split=split),
    lambda split: fan_out(requests=1, split=split), lambda split: prompt_formats(requests=1, split=split),
], ids="abcdefghij")
def test_an_unknown_split_is_refused(build):
    with pytest.raises(ValueError, match="'dev', 'report'"):
        build("test")


def test_shared_texts_are_in_the_prompt_and_unread_replies_are_not(tokenizer):
    for workload in every_workload(tokenizer):
        assert len({r.key for r in workload.requests}) == len(workload.requests) >= 1, workload.name
        for request in workload.requests:
            replies = replies_for(request)
            assert request.shared and request.shared_texts(0, []) == []
            for k in range(1, len(request.agents)):
                text = prompt_text(tokenizer, request, k, replies)
                shared = request.shared_texts(k, replies[:k])
                assert all(s.strip() in text for s in shared), (workload.name, request.key, k)
                unread = set(replies[:k]) - set(shared)
                assert not any(reply in text for reply in unread), (workload.name, request.key, k)


def test_a_judge_picks_from_shuffled_candidates(tokenizer):
    plain = gsm8k_debate(requests=2, split="dev")
    assert plain.requests[0].agents == ("solver-1", "solver-2", "solver-3", "solver-4") and not plain.decider
    workload = gsm8k_debate(requests=8, split="dev", judge=True)
    assert workload.decider and workload.name != plain.name
    orders = []
    for request in workload.requests:
        assert request.agents == ("solver-1", "solver-2", "solver-3", "judge")
        replies = replies_for(request)
        text = prompt_text(tokenizer, request, 3, replies)
        # candidate n is the reply of solver order[n - 1]
        order = sorted(range(3), key=lambda j: text.index(replies[j]))
        assert all(f"Candidate {n}:\n{replies[j]}" in text for n, j in enumerate(order, start=1))
        orders.append(tuple(order))
    assert len(set(orders)) >= 2 and any(order != (0, 1, 2) for order in orders)
    again = gsm8k_debate(requests=8, split="dev", judge=True)
    assert [r.meta["order"] for r in again.requests] == [list(o) for o in orders]  # seeded by the row
    assert workload.final_answer(["It is 3.", "It is 4.", "It is 3.", "Candidate 2 is right: 4"]) == "4"


def test_the_changing_graph_changes_per_request_and_per_seed(tokenizer):
    workload = changing_graph(requests=8, split="dev")
    shapes = [request.agents for request in workload.requests]
    assert all(3 <= len(agents) <= 5 and agents[-1] == "finalizer" and len(set(agents)) == len(agents)
               for agents in shapes)
    assert len(set(shapes)) >= 2 and len({r.meta["lead_in"] for r in workload.requests}) >= 2

    def rendered(w):
        return [(r.key, r.agents, prompt_text(tokenizer, r, len(r.agents) - 1, replies_for(r))) for r in w.requests]

    assert rendered(changing_graph(requests=8, split="dev")) == rendered(workload)
    assert rendered(changing_graph(requests=8, split="dev", seed=1)) != rendered(workload)
    assert workload.final_answer(["one 1", "two 2", "The answer is 18."]) == "18" and not workload.decider


@needs_data
def test_the_changing_graph_takes_other_questions_in_the_report_split():
    dev, report = (changing_graph(requests=8, split=split).requests for split in SPLITS)
    assert not {r.shared for r in dev} & {r.shared for r in report}


def test_long_documents_are_long_and_in_every_prompt(tokenizer):
    workload = long_document(requests=len(LONG_DOCUMENTS["dev"]), split="dev")
    assert workload.reply_tokens <= 32
    with pytest.raises(ValueError, match="32"):
        long_document(requests=1, split="dev", reply_tokens=33)
    documents = [request.shared[0] for request in workload.requests]
    assert len(set(documents)) == len(documents)
    assert all(len(document) >= 5 * 1500 for document in documents)  # ~4 characters a token, with a margin
    for request in workload.requests:
        assert len(request.agents) == 4
        replies = replies_for(request)
        assert all(request.shared[0] in prompt_text(tokenizer, request, k, replies) for k in range(4))
    counted = long_document(requests=2, split="dev", doc_tokens=1500, tokenizer=tokenizer)
    assert all(len(tokenizer(r.shared[0])["input_ids"]) >= 1500 for r in counted.requests)


def test_documents_are_the_same_in_every_process():
    """pydoc shows default values' reprs, some with a memory address (``dataclasses.field``'s
    ``<... object at 0x...>``): left in, a run's prompts would differ from the next run's."""
    import subprocess
    import sys

    script = ("from benchmarks.graphs import long_document; "
              "print(repr([r.shared[0] for r in long_document(requests=6, split='report').requests]))")
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1] and "0x" not in runs[0]


@pytest.mark.embedded
def test_long_documents_are_1500_embedded_tokens():
    try:
        from transformers import AutoTokenizer

        from kvcomm_agents.embedded import embedded_model_dir

        embedded = AutoTokenizer.from_pretrained(embedded_model_dir())
    except (ImportError, OSError) as error:
        pytest.skip(f"the embedded tokenizer cannot be loaded: {error}")
    for split in SPLITS:  # the character estimate alone, no tokenizer given
        for request in long_document(requests=len(LONG_DOCUMENTS[split]), split=split).requests:
            assert len(embedded(request.shared[0], add_special_tokens=False)["input_ids"]) >= 1500


def test_fan_out_workers_read_the_plan_and_the_aggregator_reads_the_workers(tokenizer):
    workload = fan_out(requests=8, split="dev")
    assert workload.decider
    counts, orders = [], []
    for request in workload.requests:
        workers = len(request.agents) - 2
        counts.append(workers)
        assert request.agents == ("planner", *(f"worker-{j}" for j in range(1, workers + 1)), "aggregator")
        replies = replies_for(request)
        for k in range(1, workers + 1):
            text = prompt_text(tokenizer, request, k, replies)
            assert replies[0] in text and not any(reply in text for reply in replies[1:k])
        text = prompt_text(tokenizer, request, workers + 1, replies)
        assert replies[0] not in text
        order = sorted(range(workers), key=lambda j: text.index(replies[1 + j]))
        assert all(f"Candidate {n}:\n{replies[1 + j]}" in text for n, j in enumerate(order, start=1))
        orders.append(tuple(order))
    assert all(3 <= n <= 8 for n in counts) and len(set(counts)) >= 2
    assert sum(order != tuple(sorted(order)) for order in orders) >= len(orders) // 2
    assert workload.final_answer(["plan", "1", "2", "3", "I pick candidate 2: 2"]) == "2"


def test_prompt_formats_hold_the_report_splits_formats_and_pages_out():
    from benchmarks.formats import FORMATS, REFERENCE_PAGES

    assert len(FORMATS["dev"]) == len(FORMATS["report"]) == 6 and not set(FORMATS["dev"]) & set(FORMATS["report"])
    assert not set(REFERENCE_PAGES["dev"]) & set(REFERENCE_PAGES["report"])
    for split in SPLITS:  # building the report split's requests runs no model
        drawn = [r.meta["format"] for r in prompt_formats(requests=8, split=split, offset=2).requests]
        assert set(drawn[:6]) == set(FORMATS[split]) and drawn[6:] == drawn[:2], (split, drawn)
        assert [r.meta["format"] for r in prompt_formats(requests=6, split=split).requests][2:] == drawn[:4]


def test_prompt_formats_share_only_what_a_prompt_holds_verbatim(tokenizer):
    from benchmarks.formats import FORMATS

    replies_of = lambda request: [f"Plan of the {name}:\nstep {k} first\nthen step {k + 1}"  # noqa: E731
                                  for k, name in enumerate(request.agents)]
    seen = set()
    for split in SPLITS:
        for request in prompt_formats(requests=12, split=split).requests:
            name = request.meta["format"]
            seen.add(name)
            replies = replies_of(request)
            assert 3 <= len(request.agents) <= 4 and len(set(request.agents)) == len(request.agents)
            for k in range(1, len(request.agents)):
                text = prompt_text(tokenizer, request, k, replies)
                shared = request.shared_texts(k, replies[:k])
                assert all(s.strip() in text for s in shared), (name, k)
                if name in ("blockquotes", "json-state"):  # replies changed on the way: not shared
                    assert not set(replies) & set(shared) and not any(reply in text for reply in replies)
                elif name == "first-lines":  # a reply's first line, not the rest
                    assert [s for s in shared if s not in request.shared] == [r.split("\n")[0] for r in replies[:k]]
                    assert not any(reply in text for reply in replies)
                else:
                    assert all(reply in text for reply in replies[:k]) and replies[k] not in text
            if name == "json-state":  # the task and the page escaped: nothing shared
                assert request.shared == ()
            else:
                assert len(request.shared) == 2 and request.shared[0] in text
    assert seen == set(FORMATS["dev"]) | set(FORMATS["report"])
