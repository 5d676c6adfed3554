"""A short first sample of re-rotation (kvcomm_agents.rerotation_check.RerotationCheck.short_sample):
before any re-rotation sample, a reader of a long shared text is measured on its prompt with the
text cut short, and served re-rotated where that sample is clear."""

from __future__ import annotations

import torch

from kvcomm_agents import ExperimentalSettings, KVCommConfig, KVCommEngine
from kvcomm_agents.alignment import assemble
from kvcomm_agents.engines import hf
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.plan import ReusedRun
from kvcomm_agents.planner import plan_call
from kvcomm_agents.prompt import PromptLayout, render_prompt
from kvcomm_agents.rerotation_check import SHORT_SAMPLE_IDS, cut_runs

TOPICS = ("opening hours", "loans", "the reading room", "printing", "lost cards", "group rooms", "the archive",
          "children's books", "late fees", "donations", "wifi", "lockers")
DOCUMENT = " ".join(f"Section {i + 1}, on {topic}: the desk answers questions about {topic} every weekday, and "
                    f"the staff keep a written note of each answer about {topic} for the next visitor."
                    for i, topic in enumerate(TOPICS))


def _messages(system: str, notes: tuple[str, ...] = ()) -> list[dict]:
    return ([{"role": "system", "content": system}, {"role": "user", "content": f"Document:\n{DOCUMENT}"}]
            + [{"role": "user", "content": f"Note: {note}"} for note in notes])


SENDER = "You skim the document and write one short note."
READERS = ("You check the note against the document.", "You answer from the document and the note.")
NOTE = "The desk answers on weekdays."


def _config(budget: float, short: bool = True) -> KVCommConfig:
    return KVCommConfig(kl_budget=budget, remember_measurements=False,
                        experimental=ExperimentalSettings(short_rerotation_sample=short))


def _graph(engine: KVCommEngine, tokenizer) -> list:
    note_ids = tokenizer(NOTE, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    stats = [engine.replay(_messages(SENDER), agent="skimmer", reply_ids=note_ids).result.stats]
    for k, system in enumerate(READERS):
        stats.append(engine.replay(_messages(system, (NOTE,)), agent=f"reader-{k}",
                                   reply_ids=[tokenizer.eos_token_id]).result.stats)
    return stats


def test_the_document_is_long_enough_to_cut(tokenizer):
    assert len(tokenizer(DOCUMENT)["input_ids"]) > 4 * SHORT_SAMPLE_IDS


def test_a_clear_short_sample_serves_the_first_reader_re_rotated(model, tokenizer):
    """Within the budget the first reader is served the document re-rotated after a sample
    costing a fraction of its prompt (charged as audit ids); without the short sample it computes
    the document, and its check forwards it once more re-rotated."""
    short = _graph(KVCommEngine(model, tokenizer, config=_config(50.0)), tokenizer)
    whole = _graph(KVCommEngine(model, tokenizer, config=_config(50.0, short=False)), tokenizer)
    doc = len(tokenizer(DOCUMENT)["input_ids"])
    first, first_whole = short[1], whole[1]
    assert first.reused_tokens > doc // 2 and first_whole.reused_tokens < doc // 2
    assert 0 < first.forwarded.audit < first.prompt_tokens // 2  # the short sample: far less than the prompt
    assert first.forwarded.total < first_whole.forwarded.total // 2
    assert short[2].reused_tokens == whole[2].reused_tokens  # the second reader: trusted either way


def test_the_short_sample_measures_dense_against_re_rotated_on_the_cut_prompt(model, tokenizer):
    """The recorded sample is KL(dense || re-rotated) on the cut prompt: the same measure taken
    here by hand, from the same store."""
    engine = KVCommEngine(model, tokenizer, config=_config(50.0))
    note_ids = tokenizer(NOTE, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    engine.replay(_messages(SENDER), agent="skimmer", reply_ids=note_ids)
    reader = _messages(READERS[0], (NOTE,))
    check = engine._calls.parts.rerotation_check
    rerotate = engine.config.model_copy(update={"method": "rerotate", "dense_when_cheaper": False})
    whole = plan_call(render_prompt(tokenizer, reader), store=engine.store, fingerprint=engine.fingerprint,
                      config=rerotate, agent="reader-0")
    cut = cut_runs(whole.prompt_ids, whole.runs, SHORT_SAMPLE_IDS)
    short = plan_call(PromptLayout.of_ids(cut), store=engine.store, fingerprint=engine.fingerprint, config=rerotate,
                      agent="reader-0")
    with torch.inference_mode():
        dense = hf.prefill(model, cut, torch.arange(cut.numel())).logits
        reused = hf.prefill(model, cut, short.computed_positions(), assemble(short, engine.info.rotator),
                            short.reused_positions(), masked=True).logits
    expected = first_token_kl(dense, reused)
    assert check.short_sample_due("reader-0")
    engine.replay(reader, agent="reader-0", reply_ids=[tokenizer.eos_token_id])
    (kl,) = engine.anchors.tracker.rerotation_samples("reader-0")
    assert expected > 0 and abs(kl - expected) <= 1e-5 + 1e-3 * expected
    assert not check.short_sample_due("reader-1")  # one sample on the model: none more


def test_a_short_sample_over_a_quarter_of_the_budget_is_not_trusted(model, tokenizer):
    """Not clear: nothing recorded from it, the reader computes the document as without it, and
    its whole check records the model's first sample; no second short sample under the same
    weights."""
    engine = KVCommEngine(model, tokenizer, config=_config(1e-9))
    stats = _graph(engine, tokenizer)
    without = _graph(KVCommEngine(model, tokenizer, config=_config(1e-9, short=False)), tokenizer)
    assert stats[1].reused_tokens == without[1].reused_tokens
    assert stats[1].forwarded.audit > without[1].forwarded.audit  # the short sample, then the whole check
    assert len(engine.anchors.tracker.rerotation_samples("reader-0")) == 1  # the whole check's alone
    assert not engine._calls.parts.rerotation_check.short_sample_due("reader-1")


def test_no_short_sample_where_the_model_was_measured_or_the_text_is_short(model, tokenizer):
    engine = KVCommEngine(model, tokenizer, config=_config(50.0))
    engine.anchors.tracker.remember([0.001])  # an earlier engine's measurement of this model
    assert not engine._calls.parts.rerotation_check.short_sample_due("reader-0")
    fresh = KVCommEngine(model, tokenizer, config=_config(50.0))
    short_doc = [{"role": "system", "content": READERS[0]}, {"role": "user", "content": "Document:\nShort."}]
    assert fresh._calls.parts.rerotation_check.short_sample(render_prompt(tokenizer, short_doc), "reader-0") is None


def test_cut_runs_keeps_each_long_runs_first_ids():
    ids = torch.arange(100)
    runs = [ReusedRun(None, 10, 0, 40), ReusedRun(None, 60, 0, 5), ReusedRun(None, 70, 0, 20)]
    cut = cut_runs(ids, runs, 8)
    assert cut.tolist() == list(range(18)) + list(range(50, 78)) + list(range(90, 100))
    assert cut_runs(ids, runs, 40) is None


def test_a_long_reply_is_not_what_a_sample_measures_by_default(model, tokenizer):
    """A reader whose only long shared text is another agent's reply: by default the reply is
    computed (``experimental.rerotate_replies`` off), and neither the short sample nor the check
    measures re-rotating it (no sample, no audit ids); with replies re-rotated, the short sample
    measures it and the reader is served the reply re-rotated."""
    reply_ids = tokenizer(DOCUMENT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for rerotate_replies in (False, True):
        engine = KVCommEngine(model, tokenizer, config=KVCommConfig(
            kl_budget=50.0, remember_measurements=False,
            experimental=ExperimentalSettings(rerotate_replies=rerotate_replies)))
        engine.replay(_messages(SENDER)[:1] + [{"role": "user", "content": "Write the library's guide."}],
                      agent="writer", reply_ids=reply_ids)
        read = engine.replay([{"role": "system", "content": READERS[0]},
                              {"role": "user", "content": f"The guide:\n{DOCUMENT}"}],
                             agent="reader", reply_ids=[tokenizer.eos_token_id]).result.stats
        reply = [d for d in read.shared_decisions if d.segment.kind == ("writer", "assistant")]
        assert reply, read.decisions
        samples = engine.anchors.tracker.rerotation_samples("reader")
        if rerotate_replies:
            assert samples and reply[0].gate.offsets == "rerotated", read.decisions
        else:
            assert samples == [] and read.forwarded.audit == 0 and reply[0].status == "prefilled", read.decisions


def test_a_short_sample_re_rotates_the_cut_run_the_whole_prompt_re_rotates(model, tokenizer):
    """A document pasted last after text it never saw is too long for ``recompute_last_run``, so
    the reader's prompt re-rotates it; cut to ``SHORT_SAMPLE_IDS`` it would fit the rule and be
    computed, and the sample would measure none of it. The sample is planned without the rule:
    it measures the cut document re-rotated, as the whole prompt serves it."""
    engine = KVCommEngine(model, tokenizer, config=_config(50.0))
    note_ids = tokenizer(NOTE, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    engine.replay(_messages(SENDER), agent="skimmer", reply_ids=note_ids)
    preamble = "Read the whole of what follows with care, and keep every section apart in your mind. " * 6
    reader = [{"role": "system", "content": READERS[0]}, {"role": "user", "content": preamble},
              {"role": "user", "content": f"Document:\n{DOCUMENT}"}]

    def plan(layout, last_run):
        config = engine.config.model_copy(update={"method": "rerotate", "dense_when_cheaper": False,
                                                  "recompute_last_run": last_run})
        return plan_call(layout, store=engine.store, fingerprint=engine.fingerprint, config=config, agent="reader-0")

    whole = plan(render_prompt(tokenizer, reader), 256)
    assert whole.runs and max(run.length for run in whole.runs) > 256  # too long for the rule: re-rotated
    cut = PromptLayout.of_ids(cut_runs(whole.prompt_ids, whole.runs, SHORT_SAMPLE_IDS))
    assert plan(cut, 256).reused_tokens < plan(cut, 0).reused_tokens  # cut short, the rule would compute it
    short = plan(cut, 0)
    with torch.inference_mode():
        dense = hf.prefill(model, short.prompt_ids, torch.arange(short.num_prompt)).logits
        reused = hf.prefill(model, short.prompt_ids, short.computed_positions(), assemble(short, engine.info.rotator),
                            short.reused_positions(), masked=True).logits
    expected = first_token_kl(dense, reused)
    engine.replay(reader, agent="reader-0", reply_ids=[tokenizer.eos_token_id])
    (kl,) = engine.anchors.tracker.rerotation_samples("reader-0")
    assert expected > 0 and abs(kl - expected) <= 1e-5 + 1e-3 * expected
