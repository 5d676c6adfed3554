"""What a benchmark graph is, which task rows it may use, and the graphs that are more than a
fixed pipeline. Import these names from :mod:`benchmarks.workloads`, which re-exports them.

- :class:`Request` and :class:`Workload`: one run of a graph of agents, and a named list of them.
- :data:`SPLITS`: the development and report ranges of the task data (see
  :mod:`benchmarks.workloads` for what each is for), with :func:`gsm8k_rows` and
  :func:`humaneval_rows` to read a split's rows.
- ``changing_graph``: (g) a graph whose agents, order and wording change per request.
- ``long_document``: (h) four agents over one long document, with short notes: prefill-heavy.
- ``fan_out``: (i) a planner, a fan-out of parallel workers and an aggregator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from examples.tasks import (
    DEFAULT_GSM8K, DEFAULT_HUMANEVAL, gold_answer, gsm8k_questions, last_number, load_problems, stdlib_doc,
)

#: The two ranges of every data source: "dev" for tests, tracing and tuning; "report" for the
#: figures the README and the benchmark quote.
SPLITS = ("dev", "report")
#: Rows of ``gsm8k-dev.jsonl`` (500) and ``humaneval-dev.jsonl`` (80) in each split.
GSM8K_RANGES = {"dev": range(0, 250), "report": range(250, 500)}
HUMANEVAL_RANGES = {"dev": range(0, 40), "report": range(40, 80)}


def check_split(split: str) -> str:
    """``split`` itself if it is one of :data:`SPLITS`, else ValueError."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {', '.join(map(repr, SPLITS))}")
    return split


def _window(size: int, split: str, offset: int, requests: int) -> range:
    """Entries ``offset..offset + requests - 1`` of a split of ``size`` entries, else ValueError."""
    if offset < 0 or requests < 0 or offset + requests > size:
        raise ValueError(f"entries {offset}..{offset + requests - 1} are outside the {split} split ({size} entries)")
    return range(offset, offset + requests)


def split_entries(table: dict[str, list], split: str, offset: int, requests: int) -> list[tuple[int, object]]:
    """(index, entry) for entries ``offset..`` of the split's list in ``table`` (a built-in one)."""
    entries = table[check_split(split)]
    return [(i, entries[i]) for i in _window(len(entries), split, offset, requests)]


def _split_rows(load: Callable[[int, Path], list[dict]], path: Path, ranges: dict[str, range], split: str,
                offset: int, requests: int) -> list[tuple[int, dict]]:
    """(row index in the file, row) for rows ``offset..offset + requests - 1`` of the split's range
    of the file at ``path``, read by ``load(n, path)``. Without the file ``load`` gives the built-in
    rows, which both splits then share (from index 0, possibly fewer than asked)."""
    span = ranges[check_split(split)]
    window = _window(len(span), split, offset, requests)
    if not path.is_file():
        return list(enumerate(load(window.stop, path)))[offset:]
    wanted = span[window.start:window.stop]
    rows = load(wanted.stop, path)
    if len(rows) < wanted.stop:
        raise ValueError(f"{path} has {len(rows)} rows; the {split} split needs {wanted.stop}")
    return [(i, rows[i]) for i in wanted]


def gsm8k_rows(split: str, offset: int, requests: int) -> list[tuple[int, dict]]:
    """(row index, GSM8K row) for ``requests`` rows from ``offset`` on in the split's range."""
    return _split_rows(gsm8k_questions, DEFAULT_GSM8K, GSM8K_RANGES, split, offset, requests)


def humaneval_rows(split: str, offset: int, requests: int) -> list[tuple[int, dict]]:
    """(row index, HumanEval problem) for ``requests`` rows from ``offset`` on in the split's range."""
    return _split_rows(load_problems, DEFAULT_HUMANEVAL, HUMANEVAL_RANGES, split, offset, requests)


def seeded(*parts) -> random.Random:
    """A random generator seeded from ``parts`` (a graph's name, its seed, the split, the row):
    the same parts give the same numbers on every run and platform."""
    return random.Random("/".join(map(str, parts)))


# ---- requests and workloads -----------------------------------------------------------------
@dataclass
class Request:
    """One run of a graph. ``messages(k, replies)``: agent ``k``'s prompt given the earlier agents'
    replies (texts). ``gold``: the task's answer, if it has one. ``reads[k]``: the indices of the
    earlier agents whose replies agent ``k``'s prompt contains (None: every earlier agent).
    ``shared``: texts other than replies that the prompts of several agents embed verbatim.
    ``quote(reply)``: what of a reply the readers' prompts hold verbatim, None for nothing (a
    format that changes replies on the way); without ``quote``, the whole reply."""

    key: str
    agents: tuple[str, ...]
    messages: Callable[[int, list[str]], list[dict]]
    gold: Optional[str] = None
    meta: dict = field(default_factory=dict)
    task: Optional[str] = None  # the task's text, which every agent's prompt embeds (shared text)
    reads: Optional[tuple[tuple[int, ...], ...]] = None
    shared: tuple[str, ...] = ()
    quote: Optional[Callable[[str], Optional[str]]] = None

    def shared_texts(self, k: int, replies: list[str]) -> list[str]:
        """The texts in agent ``k``'s prompt that an earlier agent of this request already read or
        wrote: the shared texts and the replies agent ``k`` reads (none for the first agent)."""
        if k == 0:
            return []
        read = range(k) if self.reads is None else self.reads[k]
        quoted = [replies[j] if self.quote is None else self.quote(replies[j]) for j in read]
        return list(self.shared) + [text for text in quoted if text is not None]


@dataclass
class Workload:
    """A named list of requests. ``exact_replies``: replies are generated to exactly
    ``reply_tokens`` tokens (end-of-sequence suppressed), as the paper's TTFT setting fixes O.
    ``decider``: the last agent decides between candidates (a judge, an aggregator), and
    ``final_answer(replies)`` reads its pick from the last reply."""

    name: str
    title: str
    requests: list[Request]
    reply_tokens: int
    exact_replies: bool = False
    final_answer: Optional[Callable[[list[str]], Optional[str]]] = None
    decider: bool = False


def last_reply_number(replies: list[str]) -> Optional[str]:
    """The last number of the last reply (the answer of a graph whose last agent decides)."""
    return last_number(replies[-1]) if replies else None


def candidates(replies: list[str], order: list[int]) -> list[dict]:
    """The replies as user messages "Candidate 1", "Candidate 2", ... in the given order."""
    return [{"role": "user", "content": f"Candidate {n}:\n{replies[j]}"} for n, j in enumerate(order, start=1)]


def shuffled(n: int, rng: random.Random) -> list[int]:
    """``0..n-1`` in an order drawn from ``rng``."""
    order = list(range(n))
    rng.shuffle(order)
    return order


# ---- (g) a graph that changes per request ---------------------------------------------------
#: The roles of (g) and their system texts; the finalizer always speaks last.
ROLES = {
    "planner": "You plan how to solve a math word problem in a few short steps. Do not compute the answer.",
    "solver": "You solve a math word problem step by step and end with the final number.",
    "checker": "You check the team's work on a math word problem step by step and end with the correct number.",
    "skeptic": "You look for a mistake in the team's reasoning about a math word problem, then end with the "
               "number you believe.",
    "explainer": "You explain the solution of a math word problem simply, for a student, ending with the final number.",
    "finalizer": "You give the team's final answer to a math word problem: one short sentence ending with the number.",
}
#: How (g) pastes an earlier reply, one style per request.
LEAD_INS = ("{Role}'s answer:\n", "Here is what the {role} wrote:\n", "--- {role} ---\n", "Reply from the {role}:\n",
            "[{role}]\n")


def route(rng: random.Random, spoken: list[str]) -> str:
    """(g)'s router: who speaks next, drawn from the roles that have not spoken (the finalizer is
    kept for the end)."""
    return rng.choice([role for role in ROLES if role not in spoken and role != "finalizer"])


def changing_graph(*, requests: int, split: str = "report", offset: int = 0, reply_tokens: int = 64,
                   seed: int = 0) -> Workload:
    """(g) A graph that changes per request, as with a router node (an LLM or rules choosing the
    next agent): per request a generator seeded from (``seed``, split, row) draws how many agents
    speak (3-5), which of :data:`ROLES` and in what order (:func:`route`), always ending with the
    finalizer, and how earlier replies are pasted (one of :data:`LEAD_INS`). Each prompt is one
    user message embedding the GSM8K question and every earlier reply; the answer is the
    finalizer's last number."""
    built = []
    for row, problem in gsm8k_rows(split, offset, requests):
        rng = seeded("changing_graph", seed, split, row)
        names: list[str] = []
        for _ in range(rng.randint(3, 5) - 1):
            names.append(route(rng, names))
        names.append("finalizer")
        lead_in = rng.choice(LEAD_INS)

        def messages(k: int, replies: list[str], names=tuple(names), lead_in=lead_in,
                     question=problem["question"]) -> list[dict]:
            parts = [f"Problem: {question}"]
            parts += [lead_in.format(role=name, Role=name.capitalize()) + reply for name, reply in zip(names, replies)]
            parts.append(f"Now do your part as the {names[k]}.")
            return [{"role": "system", "content": ROLES[names[k]]}, {"role": "user", "content": "\n\n".join(parts)}]

        built.append(Request(f"q{row}", tuple(names), messages, gold=gold_answer(problem),
                             shared=(problem["question"],), meta={"lead_in": lead_in}))
    return Workload("changing_graph", f"(g) changing graph: 3-5 of {len(ROLES)} roles per request, seed {seed}",
                    built, reply_tokens, final_answer=last_reply_number)


# ---- (h) a long document, short notes -------------------------------------------------------
#: (h)'s documents per split: the pages of related standard-library objects (rendered offline
#: by pydoc, as many as the length asks, in order) and a question about them.
LONG_DOCUMENTS = {
    "dev": [
        (("collections.deque", "collections.OrderedDict", "collections.defaultdict", "collections.ChainMap",
          "collections.namedtuple", "collections.UserDict"),
         "Which of these containers adds and removes items quickly at both ends, and what does maxlen do?"),
        (("datetime.timedelta", "datetime.date", "datetime.datetime", "datetime.timezone", "datetime.time"),
         "How does timedelta normalise its arguments into days, seconds and microseconds?"),
        (("threading.Thread", "threading.Lock", "threading.Event", "threading.Condition", "threading.Semaphore",
          "threading.Timer"),
         "What happens when Thread.join is called with a timeout?"),
        (("argparse", "argparse.ArgumentParser", "argparse.Action", "argparse.Namespace", "argparse.FileType",
          "argparse.HelpFormatter"),
         "Which keyword arguments does ArgumentParser accept?"),
        (("logging.Logger", "logging.Handler", "logging.Formatter", "logging.basicConfig", "logging.LoggerAdapter",
          "logging.Filter"),
         "What does logging.basicConfig do when the root logger already has handlers?"),
        (("pathlib.PurePath", "pathlib.Path", "pathlib.PurePosixPath", "pathlib.PureWindowsPath"),
         "How do PurePosixPath and PureWindowsPath differ from Path?"),
    ],
    "report": [
        (("csv", "csv.DictReader", "csv.DictWriter", "csv.Sniffer", "csv.Dialect", "csv.reader", "csv.writer"),
         "What does csv.DictReader use as field names when fieldnames is omitted?"),
        (("enum.Enum", "enum.IntEnum", "enum.Flag", "enum.IntFlag", "enum.unique", "enum.auto"),
         "How are the members of a Flag enumeration combined?"),
        (("decimal.Decimal", "decimal.Context", "fractions.Fraction", "numbers.Rational"),
         "How does a decimal Context control precision and rounding?"),
        (("dataclasses", "dataclasses.dataclass", "dataclasses.field", "dataclasses.asdict", "dataclasses.replace",
          "dataclasses.fields", "dataclasses.make_dataclass"),
         "Which methods does the dataclass decorator add to a class?"),
        (("queue.Queue", "queue.PriorityQueue", "queue.LifoQueue", "queue.SimpleQueue"),
         "In what order does a PriorityQueue return its entries?"),
        (("unittest.mock.Mock", "unittest.mock.MagicMock", "unittest.mock.patch", "unittest.mock.call",
          "unittest.TestCase"),
         "What does unittest.mock.patch do when it is used as a decorator?"),
    ],
}
#: Characters of one page at most, and characters per token assumed without a tokenizer (pydoc
#: text runs 3.1-4.0 characters per SmolLM2 token: 5 leaves a margin).
PAGE_CHARS = 4000
CHARS_PER_TOKEN = 5
#: (h)'s four agents and their system texts: each writes a short note.
NOTE_TAKERS = {
    "skimmer": "Read the document and note in one or two sentences where it answers the question.",
    "fact-finder": "Quote the one fact from the document that answers the question, in a short note.",
    "checker": "Check the earlier notes against the document and note any error in one sentence.",
    "answerer": "Answer the question in one or two sentences from the document and the notes.",
}
MAX_NOTE_TOKENS = 32


def long_text(pages: tuple[str, ...], doc_tokens: int, tokenizer=None) -> str:
    """The pages' documentation, page after page, cut at the end of the first line that makes
    it ``doc_tokens`` tokens long (counted with ``tokenizer``, else estimated at
    :data:`CHARS_PER_TOKEN` characters a token): the document is as long as asked, not a page's
    worth more (whole pages overshot 1,500 tokens by a third)."""
    def long_enough(text: str) -> bool:
        if tokenizer is None:
            return len(text) >= CHARS_PER_TOKEN * doc_tokens
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= doc_tokens

    text = ""
    for name in pages:
        text = f"{text}\n\n{stdlib_doc(name, PAGE_CHARS)}".strip()
        if long_enough(text):
            lines = text.split("\n")
            low, high = 1, len(lines)  # the fewest lines that are long enough
            while low < high:
                middle = (low + high) // 2
                low, high = (low, middle) if long_enough("\n".join(lines[:middle])) else (middle + 1, high)
            return "\n".join(lines[:low])
    raise ValueError(f"the pages {pages} are shorter than {doc_tokens} tokens")


def long_document(*, requests: int, split: str = "report", offset: int = 0, reply_tokens: int = 32,
                  doc_tokens: int = 1500, tokenizer=None) -> Workload:
    """(h) Prefill-heavy: a document-QA team (as in a RAG graph whose nodes all take the retrieved
    document). Four agents (:data:`NOTE_TAKERS`) each read the same long document of at least
    ``doc_tokens`` tokens (:func:`long_text`, a different one per request), a question about it
    and every earlier agent's note, and write a note of at most 32 tokens."""
    if reply_tokens > MAX_NOTE_TOKENS:
        raise ValueError(f"reply_tokens={reply_tokens}: (h)'s notes are at most {MAX_NOTE_TOKENS} tokens")
    names = tuple(NOTE_TAKERS)
    built = []
    for i, (pages, question) in split_entries(LONG_DOCUMENTS, split, offset, requests):
        document = long_text(pages, doc_tokens, tokenizer)
        question_line = f"Question: {question}"

        def messages(k: int, replies: list[str], document=document, question_line=question_line) -> list[dict]:
            out = [{"role": "system", "content": NOTE_TAKERS[names[k]]},
                   {"role": "user", "content": f"Document:\n\n{document}"}, {"role": "user", "content": question_line}]
            return out + [{"role": "user", "content": f"Note from the {names[j]}:\n{reply}"}
                          for j, reply in enumerate(replies)]

        built.append(Request(f"doc-{split}-{i}", names, messages, shared=(document, question_line),
                             meta={"pages": pages}))
    return Workload("long_document", f"(h) long document: {len(names)} agents, >= {doc_tokens} tokens, "
                    f"notes <= {reply_tokens} tokens", built, reply_tokens)


# ---- (i) fan-out and aggregate --------------------------------------------------------------
#: How (i)'s worker ``j`` is told to solve the problem (``APPROACHES[j - 1]``).
APPROACHES = ("working forwards from the given quantities", "working backwards from what is asked",
              "writing one equation and solving it", "making a table of the quantities",
              "estimating first, then computing exactly", "breaking the problem into the smallest steps",
              "checking the units at every step", "restating the problem in your own words first")


def fan_out(*, requests: int, split: str = "report", offset: int = 0, reply_tokens: int = 64,
            seed: int = 0) -> Workload:
    """(i) A LangGraph ``Send`` fan-out: a planner reads the GSM8K question and writes a plan; W
    workers (3-8, drawn per request from (``seed``, split, row)) each read the question and the
    plan, not each other, and solve it each their own way (:data:`APPROACHES`); an aggregator
    reads the question and the workers' replies (not the plan) as candidates in an order
    shuffled per request, and ends with the number it picks."""
    built = []
    for row, problem in gsm8k_rows(split, offset, requests):
        rng = seeded("fan_out", seed, split, row)
        workers = rng.randint(3, 8)
        order = shuffled(workers, rng)
        names = ("planner", *(f"worker-{j}" for j in range(1, workers + 1)), "aggregator")

        def messages(k: int, replies: list[str], workers=workers, order=tuple(order),
                     question=problem["question"]) -> list[dict]:
            if k == 0:
                system = ("You are the planner of a team of workers solving a math word problem. Write a short "
                          "plan of the steps; do not compute the answer.")
                return [{"role": "system", "content": system}, {"role": "user", "content": question}]
            if k <= workers:
                system = (f"You are worker {k} of {workers}. Solve the math word problem following the plan, "
                          f"by {APPROACHES[k - 1]}. End with the final number.")
                return [{"role": "system", "content": system}, {"role": "user", "content": question},
                        {"role": "user", "content": f"Plan:\n{replies[0]}"}]
            system = ("You aggregate the workers' solutions of a math word problem, given in no particular order. "
                      "Decide which candidate is correct and end with its final number.")
            return ([{"role": "system", "content": system}, {"role": "user", "content": question}]
                    + candidates(replies[1:], list(order)))

        reads = ((),) + ((0,),) * workers + (tuple(range(1, workers + 1)),)
        built.append(Request(f"q{row}", names, messages, gold=gold_answer(problem), reads=reads,
                             shared=(problem["question"],), meta={"order": order}))
    return Workload("fan_out", f"(i) fan-out: planner, 3-8 workers, aggregator, seed {seed}", built, reply_tokens,
                    final_answer=last_reply_number, decider=True)
