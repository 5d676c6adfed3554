"""Lead-outs: the shared text a reader puts right after a sender's reply (one-message prompts'
closing line), fed to the reply's copies after the reply and recorded as a version of the stored
text readers find it in (kvcomm_agents.framing, "Lead-outs"), on both tiny model families."""

import dataclasses

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.kv.segments import CONTEXT_TOKENS
from kvcomm_agents.versions.match import framed_receiver
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.framing.replies import ReaderFraming
from kvcomm_agents.plan import CallPlan, Observation
from kvcomm_agents.prompt import render_prompt

from .anchors.synthetic import KIND, segment
from .conftest import first_logits, tol
from .test_framing import FRAMED, HEADER, QUESTION, REPLIES, SENDER
from .conftest import mechanics


CLOSING = "Check the solutions above, then give your own answer."


def _one_message(question: str, replies: list[str]) -> list[dict]:
    """(e)'s prompt: one user message, the problem, earlier solutions, a closing line."""
    parts = [f"Problem: {question}"] + [f"Solution from solver {j}:\n{r}" for j, r in enumerate(replies, start=1)]
    return [{"role": "system", "content": "You are a solver."},
            {"role": "user", "content": "\n\n".join(parts + [CLOSING])}]


#: short runs computed whole, no head: a framed copy that fits still serves its run whole
SHORT_RUNS = FRAMED.model_copy(update={"recompute_head": 0, "recompute_short_runs": 64})


@pytest.mark.parametrize("config", [FRAMED, SHORT_RUNS], ids=["head", "short-runs"])
@pytest.mark.parametrize("ends_with_eos", [True, False], ids=["eos", "cut-short"])
def test_a_closing_line_after_the_reply_is_computed_in_the_copy_and_reused_exactly(model, tokenizer, ends_with_eos,
                                                                                   config):
    """(e)'s one-message prompt: the reader reads the sender's reply, then a closing line that
    earlier prompts hold after other text. The closing line is learned as the framing's lead-out;
    the sender feeds it to its copy after the reply (and after the reply's last id, never fed,
    when the reply was cut short) and records it as a version of the text it is stored in. The
    reader then reuses everything it shares, the closing line from that version, and its first
    token is dense's (the short reply too where short runs are computed: a framed copy fits it)."""
    engine = KVCommEngine(model, tokenizer, config=config)
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    for r in range(2):
        question = f"{QUESTION} Say it for basket {'XY'[r]}."
        reply = REPLIES[r]
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        reply_ids = reply_ids + [tokenizer.eos_token_id] if ends_with_eos else reply_ids
        sent = engine.replay(_one_message(question, []), agent="s1", reply_ids=reply_ids).result
        messages = _one_message(question, [reply])
        read = engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id])
    (rule,) = engine._framer.reply_framing.rules("s1")
    assert tokenizer.decode(rule.lead_out).strip().endswith(CLOSING[-20:]), rule
    assert sent.stats.framed_versions == 2  # the reply and its lead-out
    stats = read.result.stats
    reply, closing = stats.decisions[-2:]  # the reader's lead-in before them is its own earlier prompt's text
    assert reply.segment.kind == ("s1", "assistant") and closing.segment.kind[1] != "assistant", stats.decisions
    assert closing.status == "reused" and closing.gate.offsets == "framed", stats.decisions
    assert reply.status == "reused" and reply.gate.offsets == "framed", stats.decisions
    # a framed version fits from the reply's first token: no head recomputed, nor the short run whole
    assert reply.reused_tokens == reply.segment.num_tokens, reply
    torch.testing.assert_close(read.first_token_logits, first_logits(dense, messages, agent="s2"),
                               atol=tol(1e-4), rtol=0)


def test_a_closing_line_after_a_reply_too_short_to_keep_is_still_reused(model, tokenizer):
    """A reply shorter than a token run is not kept (its readers compute it), but the sender's
    copy still fed it and the closing line after it: the line's version is recorded from the ids
    fed, and the reader reuses the line after computing the reply."""
    engine = KVCommEngine(model, tokenizer, config=FRAMED)
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    for r, reply in enumerate([REPLIES[0], "Nine."]):
        question = f"{QUESTION} Say it for basket {'XY'[r]}."
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sent = engine.replay(_one_message(question, []), agent="s1", reply_ids=reply_ids).result
        messages = _one_message(question, [reply])
        read = engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id])
    assert len(reply_ids) - 1 < engine.config.min_match_tokens and sent.stats.framed_versions >= 1
    decisions = read.result.stats.decisions
    assert not any(d.segment is not None and d.segment.kind == ("s1", "assistant") and d.status == "reused"
                   for d in decisions), decisions
    closing = decisions[-1]
    assert closing.status == "reused" and closing.gate.offsets == "framed", decisions
    torch.testing.assert_close(read.first_token_logits, first_logits(dense, messages, agent="s2"),
                               atol=tol(1e-4), rtol=0)


@pytest.mark.embedded
@pytest.mark.parametrize("newlines", [1, 2])
def test_a_closing_line_after_a_reply_ending_in_newlines_is_reused_though_its_ids_differ(merging, newlines):
    """A reply cut short in newlines (generated one by one: ``'\n'`` ids), pasted before the
    reader's ``\n\nCheck ...``: the reader's prompt tokenizes the newlines merged
    (``'\n\n', '\n'`` or ``'\n\n\n', '\n'``), where the sender's copy fed the reply's ids,
    then the lead-out (learned from a reply that did not end in a newline). The text is the same,
    the ids before the line are not: the version is found with whitespace compared as text
    (kvcomm_agents.versions.token_texts), the run starting after the reader's whitespace ids (computed),
    and the first token stays near dense's (closer than re-rotation only). With two newlines the stored reply holds fewer ids
    than the copy was fed (its trailing ``'\n', '\n'`` tokenize otherwise on their own): the
    lead-out is recorded from the ids fed, not the stored reply's."""
    model, tokenizer = merging
    engine = KVCommEngine(model, tokenizer, config=FRAMED)
    rerotate = KVCommEngine(model, tokenizer, config=mechanics(method="rerotate"))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    newline = tokenizer.convert_tokens_to_ids("Ċ")
    for r, (reply, extra) in enumerate([(REPLIES[0], 0), (REPLIES[1], newlines)]):
        question = f"{QUESTION} Say it for basket {'XY'[r]}."
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [newline] * extra  # cut short
        messages = _one_message(question, [tokenizer.decode(reply_ids)])
        reads = []
        for each in (engine, rerotate):
            each.replay(_one_message(question, []), agent="s1", reply_ids=reply_ids)
            reads.append(each.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id]))
        read, rerotated = reads
    ids = render_prompt(tokenizer, messages).ids.tolist()
    tokens = tokenizer.convert_ids_to_tokens(ids)
    check = tokens.index("Check")
    assert tokens[check - 2:check] == ["Ċ" * (newlines + 1), "Ċ"], tokens[check - 4:check + 1]  # merged
    closing = read.result.stats.decisions[-1]
    assert closing.segment.kind[1] != "assistant" and closing.span[0] == check, read.result.stats.decisions
    assert closing.status == "reused" and closing.gate.offsets == "framed", closing
    reference = first_logits(dense, messages, agent="s2")
    kl = first_token_kl(reference, read.first_token_logits)
    # near dense (the closing line's version was computed after the same text, other whitespace
    # ids) and closer than re-rotation only on both families
    assert kl < 1e-2 and kl < first_token_kl(reference, rerotated.first_token_logits), kl
    engine.versions.token_texts = None  # mutation check: compared as ids, the version does not fit
    again = engine.replay(messages, agent="s3", reply_ids=[tokenizer.eos_token_id]).result.stats.decisions[-1]
    assert not (again.status == "reused" and again.gate is not None and again.gate.offsets == "framed"), again


def test_a_lead_out_is_learned_only_right_after_a_whole_reply_and_only_short():
    """The shared text must start within LEAD_OUT_GAP ids of the reply's stored ids and be at
    most MAX_LEAD_OUT ids; a later rule without a lead-out keeps the framing's lead-out."""
    from kvcomm_agents.framing.replies import LEAD_OUT_GAP, MAX_LEAD_OUT
    seg = dataclasses.replace(segment(1, tokens=6), context_ids=SENDER + HEADER)
    closing = segment(2, tokens=MAX_LEAD_OUT + 1, kind=("x", "user"))  # stored shared text
    lead_in = (60, 61)
    start = 1 + len(SENDER) + len(lead_in)

    def plan(gap: int, length: int) -> CallPlan:
        ids = (1,) + SENDER + lead_in + tuple(range(6)) + (9,) * gap + tuple(range(200, 200 + length)) + HEADER
        return CallPlan(torch.tensor(ids), observations=(Observation(seg, start, 0, 6),
                                                         Observation(closing, start + 6 + gap, 0, length)))
    book = ReaderFraming()
    book.learn(plan(LEAD_OUT_GAP, 12))
    assert book.rules(KIND[0])[0].lead_out == tuple(range(200, 212))
    book.learn(plan(LEAD_OUT_GAP + 1, 12))  # too far from the reply: no lead-out, the old one is kept
    assert book.rules(KIND[0])[0].lead_out == tuple(range(200, 212))
    fresh = ReaderFraming()
    fresh.learn(plan(0, MAX_LEAD_OUT))
    assert len(fresh.rules(KIND[0])[0].lead_out) == MAX_LEAD_OUT
    longer = ReaderFraming()
    longer.learn(plan(0, MAX_LEAD_OUT + 1))
    assert longer.rules(KIND[0])[0].lead_out == ()


def test_a_run_moves_to_the_stored_text_that_holds_its_lead_out_version():
    """The same closing line is held by many stored texts; the token-run lookup may match a
    reader's line to another one than the lead-out's version went to. The planner moves the run
    there when only that one has a version fitting the text before it, and not otherwise."""
    from kvcomm_agents.anchors import KVCommAnchors
    from kvcomm_agents.kv.rope import RopeRotator
    from kvcomm_agents.matching import TokenMatch
    from kvcomm_agents.planner import _RunDecider
    from kvcomm_agents.prompt import PromptLayout
    from kvcomm_agents.versions import Versions

    from .anchors.synthetic import DIM

    line = tuple(range(300, 312))  # the closing line's ids
    matched = dataclasses.replace(segment(5, tokens=20, kind=("user", None)), token_ids=(1,) * 8 + line)
    home = dataclasses.replace(segment(6, tokens=16, kind=("user", None)), token_ids=(2,) * 4 + line)
    before = tuple(range(900, 980))  # the reader's ids before the line: its prompt, then the reply
    anchors = KVCommAnchors(estimator="mean", max_bytes=1 << 30)
    versions = Versions(anchors)
    rotator = RopeRotator(torch.ones(DIM // 2))
    real = home.kv.window(4, 16)  # stands for the copy's KV of the line (any values do)
    assert versions.record(framed_receiver(0), home, real, 100, before[-CONTEXT_TOKENS:], rotator, min_match=16,
                           segment_start=4)
    versions.homes.note(line, home.id, 4)
    layout = PromptLayout.of_ids(before + line + (7,))
    run = TokenMatch(matched, len(before), 8, len(line), 0)
    decider = _RunDecider(layout, 0, mechanics(), "reader", anchors, versions,
                          home=lambda segment_id: home if segment_id == home.id else None)
    moved = decider._at_home(run)
    assert moved.segment is home and moved.segment_start == 4 and moved.prompt_start == run.prompt_start
    elsewhere = PromptLayout.of_ids(tuple(range(500, 580)) + line + (7,))  # other text before the line
    assert _RunDecider(elsewhere, 0, mechanics(), "reader", anchors, versions,
                       home=lambda segment_id: home)._at_home(run) is run


def test_after_approximate_kv_only_the_base_version_is_taken():
    """A framed version was computed after exact text; where a run before it in this prompt holds
    re-rotated KV, it is no closer than re-rotation (measured: (a) and (d), development range,
    readers 1.5-5x further from dense than re-rotation only with it). The planner then refuses
    it and the gate decides (here: re-rotation, measured within budget for this reader)."""
    from kvcomm_agents.anchors import KVCommAnchors
    from kvcomm_agents.kv.rope import RopeRotator
    from kvcomm_agents.matching import TokenMatch
    from kvcomm_agents.planner import _RunDecider
    from kvcomm_agents.prompt import PromptLayout
    from kvcomm_agents.versions import Versions

    from .anchors.synthetic import DIM

    task = dataclasses.replace(segment(7, tokens=40, kind=("user", None)), token_ids=tuple(range(600, 640)))
    reply = dataclasses.replace(segment(8, tokens=20, kind=("s1", "assistant")), token_ids=tuple(range(700, 720)))
    ids = tuple(range(900, 940)) + task.token_ids + reply.token_ids + (7,)
    at = 80  # the reply's first prompt position
    config = mechanics()
    anchors = KVCommAnchors(estimator="mean", max_bytes=1 << 30, kl_budget=config.kl_budget,
                            rerotate_replies=config.experimental.rerotate_replies)
    versions = Versions(anchors)
    rotator = RopeRotator(torch.ones(DIM // 2))
    assert versions.record(framed_receiver(0), reply, reply.kv, at, ids[at - CONTEXT_TOKENS:at], rotator,
                           min_match=16)

    def decided(samples: int):
        for _ in range(samples):
            anchors.tracker.record_rerotated("reader", 0.0)
        decider = _RunDecider(PromptLayout.of_ids(ids), 0, config, "reader", anchors, versions)
        first = decider.decide(TokenMatch(task, 40, 0, 40, 0))[1]
        return first, decider.decide(TokenMatch(reply, at, 0, 20, 0))[1]

    task_first, read = decided(0)  # nothing measured: the task is computed, the version fits after it
    assert task_first[1] == "new_anchor" and read[0] == "reused" and read[3].offsets == "framed", (task_first, read)
    task_rerotated, read = decided(anchors.tracker.min_samples)
    assert task_rerotated[0] == "reused" and task_rerotated[3].offsets == "rerotated", task_rerotated
    assert read[0] == "reused" and read[3].offsets == "rerotated", read
