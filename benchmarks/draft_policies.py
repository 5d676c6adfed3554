"""How long a reply's decode steps take under each draft-length policy, replayed on real replies.

A draft only decides how many ids a step feeds, never which are kept (:mod:`kvcomm_agents.drafting`),
so a reply's ids are the same under every policy, and what a lookup finds at each position
depends only on the ids before it and the engine's recent replies when the call began. Hence
every policy can be replayed exactly on recorded replies: at each step the policy picks a draft
length k from what it knows (earlier drafts' outcomes, the lookup's ids), the step keeps the
draft's ids that match the reply plus one, and costs a forward of k + 1 ids at the engine's
measured cost of that size.

``--capture`` runs the benchmark's graphs (``python -m benchmarks``, development range by
default) with the default engine and records, for each drafting call, its prompt and reply ids,
the recent replies it could look up and the engine's measured forward costs. Without it, the
recorded traces are replayed under each policy and a table of decode time (and ids fed) per
policy, relative to no drafts, is printed and written as JSON. No policy is tuned on the report
range: capture there only to check a choice made on the development range.

    python -m benchmarks.draft_policies --capture [--split dev] [--phases b,g,j,h] [--traces FILE]
    python -m benchmarks.draft_policies [--traces FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Callable, Optional

from kvcomm_agents.drafting import NgramDraft, RecentReplies
from kvcomm_agents.step_costs import StepCosts

__all__ = ["capture", "replay", "POLICIES"]

TRACES = Path("benchmarks/out/draft-traces.json")


def capture(argv: list[str], path: Path) -> None:
    """Run ``python -m benchmarks`` with ``argv`` and write every drafting call's trace to ``path``."""
    from benchmarks import run

    drafts, costs = [], []
    init, costs_init = NgramDraft.__init__, StepCosts.__init__

    def recording_init(self, ids, most, recent=None, **kwargs):
        init(self, ids, most, recent=recent, **kwargs)
        replies = [reply for reply, _ in recent._replies] if recent is not None else []
        drafts.append((self, len(self.ids), replies))

    def recording_costs(self, *args, **kwargs):
        costs_init(self, *args, **kwargs)
        costs.append(self)

    NgramDraft.__init__, StepCosts.__init__ = recording_init, recording_costs
    try:
        run.main(argv)
    finally:
        NgramDraft.__init__, StepCosts.__init__ = init, costs_init
    pooled: dict[int, list[float]] = {}
    for table in costs:
        for ids, samples in table._seconds.items():
            pooled.setdefault(ids, []).extend(samples)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "argv": argv, "most": drafts[0][0].most if drafts else 0,
        "costs": {ids: statistics.median(s) for ids, s in sorted(pooled.items()) if len(s) >= 3},
        "calls": [{"ids": d.ids, "start": start, "recent": recent} for d, start, recent in drafts],
    }))
    print(f"{len(drafts)} drafting calls written to {path}")


class Outcomes:
    """A call's draft outcomes so far: accepted ids, and drafts that ended in a refused id."""

    def __init__(self) -> None:
        self.history: list[tuple[int, bool]] = []  # per draft: ids kept, whether one was refused
        self.length = 2  # the adapted rule's next length

    def settle(self, drafted: int, accepted: int, most: int) -> None:
        self.history.append((accepted, accepted < drafted))
        self.length = min(most, 2 * max(self.length, drafted)) if accepted == drafted else max(1, accepted)


Policy = Callable[[Outcomes, int, dict, int], int]  # (outcomes, ids found, costs, most) -> ids to feed


def adapted(out: Outcomes, found: int, costs: dict, most: int) -> int:
    """The adapted length alone: 2 first, doubled after a whole draft, else what was kept."""
    return min(out.length, found)


def measured(out: Outcomes, found: int, costs: dict, most: int) -> int:
    """The adapted length, made longer where a forward of more ids was measured cheaper (the default)."""
    table = _table(costs)
    return table.draft_length(min(out.length, found), found)


def _table(costs: dict) -> StepCosts:
    table = StepCosts(min_samples=1)
    for ids, seconds in costs.items():
        table.record(int(ids), seconds)
    return table


def rate(prior_accepted: float, prior_refused: float, window: Optional[int] = None) -> Policy:
    """The length of most expected kept ids per second (the expected-rate rule of speculative
    decoding), the acceptance rate from the call's drafts (its last ``window``, or all) as a
    truncated geometric's estimate (kept ids over kept ids and refusals) after a prior."""
    def policy(out: Outcomes, found: int, costs: dict, most: int) -> int:
        recent = out.history[-window:] if window else out.history
        kept, refused = sum(k for k, _ in recent), sum(r for _, r in recent)
        return _best((kept + prior_accepted) / (kept + refused + prior_accepted + prior_refused), found, costs)
    return policy


def expected_kept(alpha: float, length: int) -> float:
    """Ids a draft of ``length`` keeps on average where each is kept with probability ``alpha``
    once the ids before it were: alpha + alpha^2 + ... + alpha^length."""
    return sum(alpha ** i for i in range(1, length + 1))


def _fastest(found: int, costs: dict, kept: Callable[[int], float]) -> int:
    """The draft length (0 to ``found``, sizes with a measured cost) of most kept ids, the
    step's own pick included, per second; ``kept``: the ids a draft of that length keeps."""
    best, best_rate = 0, 1 / costs[1]
    for k in range(1, found + 1):
        if k + 1 in costs and (r := (1 + kept(k)) / costs[k + 1]) > best_rate:
            best, best_rate = k, r
    return best


def _best(alpha: float, found: int, costs: dict) -> int:
    """The draft length of most expected kept ids per second at acceptance rate ``alpha``."""
    return _fastest(found, costs, lambda k: expected_kept(alpha, k))


def oracle(kept: int, found: int, costs: dict) -> int:
    """Knowing the ids the draft would keep: the length of most kept ids per second."""
    return _fastest(found, costs, lambda k: min(k, kept))


POLICIES: dict[str, Policy] = {
    "adapted": adapted,
    "measured (default)": measured,
    "rate 1:1": rate(1, 1),
    "rate 2:1": rate(2, 1),
    "rate 4:2": rate(4, 2),
    "rate 2:1, last 2": rate(2, 1, window=2),
    "rate 2:1, last 8": rate(2, 1, window=8),
}


def replay(call: dict, most: int, costs: dict, policy) -> tuple[float, int, int]:
    """One call's decode under ``policy`` (``"none"``, ``"oracle"`` or a :data:`Policy`):
    (seconds, forwards, ids fed)."""
    ids, start = call["ids"], call["start"]
    recent = RecentReplies(len(call["recent"]))
    for reply in reversed(call["recent"]):  # oldest first: the newest ends up first
        recent.add(reply)
    lookup = NgramDraft(ids[:start], most, recent=recent)
    out, seconds, forwards, fed, t = Outcomes(), 0.0, 0, 0, start
    while t < len(ids):
        room = len(ids) - t  # ids still to pick, this step's own pick included
        found = lookup._lookup(min(most, room - 1)) if room > 1 and policy != "none" else []
        kept = next((i for i, d in enumerate(found) if d != ids[t + i]), len(found))
        if not found:
            k = 0
        elif policy == "oracle":
            k = oracle(kept, len(found), costs)
        else:
            k = policy(out, len(found), costs, most)
        step_kept = min(k, kept)
        seconds += costs[k + 1]
        forwards, fed = forwards + 1, fed + k + 1
        if k:
            out.settle(k, step_kept, most)
        lookup.extend(ids[t:t + step_kept + 1])
        t += step_kept + 1
    return seconds, forwards, fed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.draft_policies", description=__doc__.split("\n")[0])
    parser.add_argument("--capture", action="store_true", help="run the graphs and record traces first")
    parser.add_argument("--split", choices=("dev", "report"), default="dev")
    parser.add_argument("--phases", default="b,g,j,h")
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/draft-policies.json"))
    args = parser.parse_args(argv)
    if args.capture:
        capture(["--split", args.split, "--phases", args.phases, "--strategies", "dense,kvcomm-mean",
                 "--out", "benchmarks/out/draft-traces", "--fresh", "--no-plots"], args.traces)
    traces = json.loads(args.traces.read_text())
    costs = {int(k): v for k, v in traces["costs"].items()}
    print("forward seconds per ids fed: " + ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in costs.items()))
    names = ["none", *POLICIES, "oracle"]
    totals = {name: [0.0, 0, 0] for name in names}
    for call in traces["calls"]:
        for name in names:
            seconds, forwards, fed = replay(call, traces["most"], costs, POLICIES.get(name, name))
            total = totals[name]
            total[0], total[1], total[2] = total[0] + seconds, total[1] + forwards, total[2] + fed
    ids = sum(len(c["ids"]) - c["start"] for c in traces["calls"])
    base = totals["none"][0]
    print(f"{len(traces['calls'])} calls, {ids} reply ids\n")
    print(f"{'policy':22} {'decode s':>9} {'x none':>7} {'forwards':>9} {'ids fed / reply id':>19}")
    for name in names:
        seconds, forwards, fed = totals[name]
        print(f"{name:22} {seconds:9.1f} {base / seconds:7.2f} {forwards:9d} {fed / ids:19.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"traces": str(args.traces), "argv": traces["argv"], "costs": costs,
                                    "reply_ids": ids, "policies": {
                                        n: {"decode_s": t[0], "forwards": t[1], "ids_fed": t[2]} for n, t in totals.items()}},
                                   indent=1) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
