"""Workloads of the benchmark and the evaluation scripts: defined once, fed identically to every
strategy (task data from :mod:`examples.tasks`).

A workload is a list of requests; each request is a graph of agents in which agent ``k``'s prompt
is ``request.messages(k, replies)`` given the replies of agents ``0..k-1``.

**Development and report ranges.** Every data source is split in two (:data:`SPLITS`):

- GSM8K (``gsm8k-dev.jsonl``): dev = rows 0-249, report = rows 250-499 (:data:`GSM8K_RANGES`);
- HumanEval (``humaneval-dev.jsonl``): dev = rows 0-39, report = rows 40-79 (:data:`HUMANEVAL_RANGES`);
- RAG: dev = :data:`RAG_REQUESTS`, report = :data:`RAG_REPORT_REQUESTS` (12 each, no page shared);
- (h)'s long documents: :data:`LONG_DOCUMENTS` per split, from different pages;
- (a) draws its shared inputs and leading texts from the split's GSM8K rows; the seeded graphs
  (g) and (i) draw their shapes from the split as well as the row.

The report range is what the README and the benchmark figures quote; tests, tracing and tuning
use ``split="dev"`` only, so nothing that shaped the code has seen the rows a figure is measured
on. Every builder takes ``split`` (default ``"report"``) and ``offset``, an offset within the
split's range; a range too short for the requests asked is a ValueError. Without the data files
(``../shared/data`` absent) both splits fall back to the same built-in rows (3 GSM8K questions,
1 HumanEval problem): fewer requests than asked, and no separation.

- ``paper_shape``: (a) the KVCOMM paper's TTFT setting: N fully connected agents, each prompt = its
  own leading text of P tokens + the shared user input of I tokens + every earlier reply (O tokens).
- ``gsm8k_debate``: (b) 4 fully connected GSM8K solvers (or 3 solvers and a judge).
- ``rag_handoff``: (c) a reader, a critic and an editor over long documentation pages.
- ``coding_pipeline``: (d) HumanEval: planner, coder, reviewer.
- ``gsm8k_one_message``: (e) (b)'s solvers in the other common prompt format: one user message
  that embeds the task and the other solvers' outputs (as the paper's agents and most hand-written
  graph nodes build it), so shared text never arrives as a whole message of its own.
- ``shared_history``: (f) three agents over two rounds on one growing message list (LangGraph's
  ``MessagesState``): each sees its own system text, the task and every earlier turn as an
  assistant message.
- ``changing_graph``, ``long_document``, ``fan_out``: (g)-(i), in :mod:`benchmarks.graphs`: a
  routed graph that changes per request, four agents over one long document, a fan-out of
  workers with an aggregator.
- ``prompt_formats``: (j), in :mod:`benchmarks.formats`: a coding team whose prompt format is
  drawn per request from formats of the split's own (the report split's formats are held out).
"""

from __future__ import annotations

from typing import Optional

from examples.tasks import (  # noqa: F401  (re-exported: the benchmark's task data)
    BUILTIN_GSM8K, BUILTIN_PROBLEMS, DATA, DEFAULT_GSM8K, DEFAULT_HUMANEVAL, debate_messages, gold_answer,
    gsm8k_questions, last_number, load_problems, stdlib_doc,
)

from .graphs import (  # noqa: F401  (re-exported: the graph types, the splits, (g)-(i))
    GSM8K_RANGES, HUMANEVAL_RANGES, LONG_DOCUMENTS, SPLITS, Request, Workload, candidates, changing_graph,
    check_split, fan_out, gsm8k_rows, humaneval_rows, last_reply_number, long_document, seeded, shuffled,
    split_entries,
)
from .formats import prompt_formats  # noqa: F401  (re-exported: (j))


# ---- the benchmark's pipelines --------------------------------------------------------------
def truncate_to_tokens(tokenizer, text: str, n: int) -> str:
    """The longest start of ``text`` that is at most ``n`` tokens (decoded back to text)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:n]).strip() if len(ids) > n else text


def _filler(questions: list[dict], start: int) -> str:
    """Plenty of natural text: GSM8K questions from ``start`` on, cycling."""
    return "\n".join(questions[(start + i) % len(questions)]["question"] for i in range(len(questions)))


def paper_shape(tokenizer, *, requests: int, split: str = "report", offset: int = 0, agents: int = 5,
                lead_tokens: int = 256, input_tokens: int = 512, reply_tokens: int = 128) -> Workload:
    """(a) N fully connected agents: own leading text (P tokens, one per agent, the same in every
    request), the shared user input (I tokens, different per request), every earlier reply. Both
    texts are made of the split's GSM8K questions; request ``r`` is input number ``offset + r``."""
    pool = [row for _, row in gsm8k_rows(split, 0, len(GSM8K_RANGES[check_split(split)]))]
    names = tuple(f"agent-{k + 1}" for k in range(agents))
    leads = [truncate_to_tokens(
        tokenizer,
        f"You are agent {k + 1} of {agents}, a careful analyst. Background notes for your role follow; "
        f"read the user's problems and the other agents' replies, then answer.\n" + _filler(pool, 17 * k + 3),
        lead_tokens) for k in range(agents)]
    built = []
    for r in range(offset, offset + requests):
        shared = truncate_to_tokens(
            tokenizer, "Solve the last of these problems.\n" + _filler(pool, 101 + 7 * r), input_tokens)

        def messages(k: int, replies: list[str], shared=shared) -> list[dict]:
            out = [{"role": "system", "content": leads[k]}, {"role": "user", "content": shared}]
            out += [{"role": "user", "content": f"Agent {j + 1} replied:\n{reply}"} for j, reply in enumerate(replies)]
            return out

        built.append(Request(f"a-{split}-{r}", names, messages, shared=(shared,)))
    return Workload("paper_shape", f"(a) paper shape: N={agents}, P={lead_tokens}, I={input_tokens}, O={reply_tokens}",
                    built, reply_tokens, exact_replies=True)


def majority_or_last(replies: list[str]) -> Optional[str]:
    """The final answer of a debate: the most common last number of the solvers (ties: the later)."""
    answers = [last_number(r) for r in replies]
    answers = [a for a in answers if a is not None]
    if not answers:
        return None
    return max(reversed(answers), key=answers.count)


def _solver_requests(requests: int, split: str, offset: int, agents: int, prompt) -> list[Request]:
    """The split's GSM8K questions ``offset..`` as requests of ``agents`` solvers; solver ``k``'s
    prompt is ``prompt(k, agents, question, replies)`` (``k`` from 1)."""
    names = tuple(f"solver-{k + 1}" for k in range(agents))
    built = []
    for row, problem in gsm8k_rows(split, offset, requests):
        def messages(k: int, replies: list[str], question=problem["question"]) -> list[dict]:
            return prompt(k + 1, agents, question, replies)

        built.append(Request(f"q{row}", names, messages, gold=gold_answer(problem), task=problem["question"],
                             shared=(problem["question"],)))
    return built


JUDGE_SYSTEM = ("You are the judge of a team solving a math word problem. The solvers' answers follow as "
                "candidates in no particular order. Decide which candidate is correct, then end with the final "
                "number of the candidate you pick.")


def _with_judge(request: Request, solvers: int) -> Request:
    """``request``'s solvers followed by a judge that reads the question and their replies as
    candidates, in an order shuffled from the request's key (its row index)."""
    order = shuffled(solvers, seeded("judge", request.key))
    solve = request.messages

    def messages(k: int, replies: list[str]) -> list[dict]:
        if k < solvers:
            return solve(k, replies)
        return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": request.task},
                *candidates(replies, order)]

    return Request(request.key, (*request.agents, "judge"), messages, gold=request.gold, task=request.task,
                   shared=request.shared, meta={"order": order})


def gsm8k_debate(*, requests: int, split: str = "report", offset: int = 0, agents: int = 4, reply_tokens: int = 128,
                 judge: bool = False) -> Workload:
    """(b) ``agents`` fully connected GSM8K solvers (no opt-out) on the split's questions
    ``offset..``; the answer is the solvers' majority. With ``judge``: ``agents - 1`` solvers,
    then a judge that reads the question and the solvers' replies as candidates (order shuffled
    per request) and ends with the number it picks, which is the answer."""
    if not judge:
        return Workload("gsm8k_debate", f"(b) GSM8K debate, {agents} solvers",
                        _solver_requests(requests, split, offset, agents, debate_messages), reply_tokens,
                        final_answer=majority_or_last)
    solvers = agents - 1
    if solvers < 1:
        raise ValueError(f"agents={agents}: a judge needs at least one solver")
    built = [_with_judge(request, solvers) for request in _solver_requests(requests, split, offset, solvers,
                                                                          debate_messages)]
    return Workload("gsm8k_debate_judge", f"(b) GSM8K debate, {solvers} solvers and a judge", built, reply_tokens,
                    final_answer=last_reply_number, decider=True)


def one_message_prompt(k: int, agents: int, question: str, replies: list[str]) -> list[dict]:
    """Solver ``k``'s prompt as one user message embedding the task and every earlier solution."""
    system = f"You are solver {k} of {agents}. Be concise and end with the final number."
    parts = [f"Solve this math word problem with the other solvers.\n\nProblem: {question}"]
    parts += [f"Solution from solver {j}:\n{reply}" for j, reply in enumerate(replies, start=1)]
    parts.append("Check the solutions above, then give your own answer.")
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def gsm8k_one_message(*, requests: int, split: str = "report", offset: int = 0, agents: int = 4,
                      reply_tokens: int = 128) -> Workload:
    """(e) (b)'s debate with every prompt one user message (:func:`one_message_prompt`)."""
    return Workload("gsm8k_one_message", f"(e) GSM8K, one message per prompt, {agents} solvers",
                    _solver_requests(requests, split, offset, agents, one_message_prompt), reply_tokens,
                    final_answer=majority_or_last)


SHARED_HISTORY_ROLES = ("proposer", "critic", "judge")


def shared_history(*, requests: int, split: str = "report", offset: int = 0, rounds: int = 2,
                   reply_tokens: int = 128) -> Workload:
    """(f) A proposer, a critic and a judge take ``rounds`` turns each on one growing message list:
    every agent sees its own system text, the task, then all earlier turns as assistant messages."""
    names = tuple(f"{role}-{r + 1}" for r in range(rounds) for role in SHARED_HISTORY_ROLES)
    built = []
    for row, problem in gsm8k_rows(split, offset, requests):
        def messages(k: int, replies: list[str], question=problem["question"]) -> list[dict]:
            role = SHARED_HISTORY_ROLES[k % len(SHARED_HISTORY_ROLES)]
            history = [{"role": "system", "content": f"You are the {role} of a team solving a math problem. "
                        "Keep your turn short and end with the number you believe is right."},
                       {"role": "user", "content": question}]
            return history + [{"role": "assistant", "content": reply} for reply in replies]

        built.append(Request(f"q{row}", names, messages, gold=gold_answer(problem), shared=(problem["question"],)))
    return Workload("shared_history", f"(f) shared history: {len(SHARED_HISTORY_ROLES)} agents x {rounds} rounds",
                    built, reply_tokens, final_answer=last_reply_number)


#: (c)'s dev split: two documentation pages (the first one answers) and a question.
RAG_REQUESTS = [
    ("json.dumps", "textwrap.shorten", "What does json.dumps do with the indent argument?"),
    ("textwrap.shorten", "textwrap.dedent", "How does textwrap.shorten truncate text that is too long?"),
    ("shutil.which", "os.path.join", "What does shutil.which return when the command is not found?"),
    ("statistics.median", "bisect.insort", "How does statistics.median handle an even number of data points?"),
    ("itertools.accumulate", "itertools.groupby", "What does itertools.accumulate return by default?"),
    ("os.path.join", "shutil.which", "What happens in os.path.join when a component is an absolute path?"),
    ("collections.Counter.most_common", "statistics.median", "In what order does Counter.most_common list elements?"),
    ("functools.lru_cache", "json.loads", "What does lru_cache do when maxsize is None?"),
    ("json.loads", "json.dumps", "Which argument of json.loads customises how objects are decoded?"),
    ("itertools.groupby", "itertools.accumulate", "Why must the input of itertools.groupby usually be sorted?"),
    ("bisect.insort", "collections.Counter.most_common", "Where does bisect.insort put an item equal to existing ones?"),
    ("textwrap.dedent", "functools.lru_cache", "What whitespace does textwrap.dedent remove?"),
]
#: (c)'s report split: other standard-library pages, none of them in the dev split.
RAG_REPORT_REQUESTS = [
    ("difflib.get_close_matches", "difflib.unified_diff", "What does the cutoff argument of get_close_matches control?"),
    ("difflib.unified_diff", "glob.glob", "How many lines of context does difflib.unified_diff show by default?"),
    ("random.sample", "random.choices", "Does random.sample choose elements with or without replacement?"),
    ("operator.itemgetter", "operator.attrgetter", "What does operator.itemgetter return when given several items?"),
    ("base64.b64decode", "base64.b64encode", "What does base64.b64decode do with non-alphabet characters by default?"),
    ("urllib.parse.urlsplit", "urllib.parse.urljoin", "Into which components does urllib.parse.urlsplit parse a URL?"),
    ("math.isclose", "math.fsum", "How do rel_tol and abs_tol decide whether math.isclose returns True?"),
    ("os.walk", "os.makedirs", "In what order does os.walk visit directories when topdown is true?"),
    ("shutil.copytree", "os.walk", "What does shutil.copytree do when the destination directory already exists?"),
    ("tempfile.mkstemp", "tempfile.NamedTemporaryFile", "Who must delete the file that tempfile.mkstemp creates?"),
    ("subprocess.run", "gzip.open", "What does subprocess.run do when check is true and the process fails?"),
    ("string.Template", "fnmatch.fnmatch", "Which delimiter does string.Template use for placeholders?"),
]
RAG_SPLITS = {"dev": RAG_REQUESTS, "report": RAG_REPORT_REQUESTS}


def rag_handoff(*, requests: int, split: str = "report", offset: int = 0, reply_tokens: int = 128,
                doc_chars: int = 3000) -> Workload:
    """(c) A reader answers from two documentation pages; a critic reads the pages, the question
    and the answer; an editor reads everything and writes the final answer."""
    systems = [
        "You answer questions about Python from the documentation given. Quote the relevant behaviour.",
        "You check an answer against the documentation given. Point out anything wrong or missing.",
        "You write the final answer from the documentation, a draft answer and a critique. Be brief.",
    ]
    built = []
    for i, (first, second, question) in split_entries(RAG_SPLITS, split, offset, requests):
        documents = f"Documents:\n\n{stdlib_doc(first, doc_chars)}\n\n{stdlib_doc(second, doc_chars)}"
        question_line = f"Question: {question}"

        def messages(k: int, replies: list[str], documents=documents, question_line=question_line) -> list[dict]:
            out = [{"role": "system", "content": systems[k]}, {"role": "user", "content": documents},
                   {"role": "user", "content": question_line}]
            labels = ["Draft answer", "Critique"]
            out += [{"role": "user", "content": f"{labels[j]}:\n{reply}"} for j, reply in enumerate(replies)]
            return out

        built.append(Request(f"rag-{split}-{i}", ("reader", "critic", "editor"), messages,
                             shared=(documents, question_line)))
    return Workload("rag_handoff", "(c) RAG hand-off, long documents", built, reply_tokens)


def coding_pipeline(*, requests: int, split: str = "report", offset: int = 0, reply_tokens: int = 128) -> Workload:
    """(d) HumanEval: a planner, a coder (problem + plan) and a reviewer (problem + plan + code)."""
    systems = [
        "You plan the solution of a Python programming task in a few short steps. Do not write code.",
        "You write the Python function for the task, following the plan. Reply with one code block.",
        "You review the code for the task against the plan and the docstring's examples. List any bug.",
    ]
    built = []
    for _, problem in humaneval_rows(split, offset, requests):
        task = f"Task: complete this function.\n```python\n{problem['prompt']}```"

        def messages(k: int, replies: list[str], task=task) -> list[dict]:
            out = [{"role": "system", "content": systems[k]}, {"role": "user", "content": task}]
            labels = ["Plan", "Code"]
            out += [{"role": "user", "content": f"{labels[j]}:\n{reply}"} for j, reply in enumerate(replies)]
            return out

        built.append(Request(problem["name"], ("planner", "coder", "reviewer"), messages, shared=(task,)))
    return Workload("coding_pipeline", "(d) HumanEval coding pipeline", built, reply_tokens)
