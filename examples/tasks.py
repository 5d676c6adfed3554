"""Task data for the examples and the benchmark: GSM8K problems, HumanEval-style problems and
offline documentation pages, with built-in fallbacks when ``../shared/data`` is absent.

The examples import from here; the benchmark's workloads build on it (never the other way round).
"""

from __future__ import annotations

import importlib
import json
import pydoc
import re
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_GSM8K = DATA / "gsm8k-dev.jsonl"
DEFAULT_HUMANEVAL = DATA / "humaneval-dev.jsonl"
BUILTIN_GSM8K = [
    {"question": "A baker makes 12 loaves in the morning and 9 in the afternoon. He sells 15. How many loaves are left?", "answer": "#### 6"},
    {"question": "Tom has 3 boxes with 8 pencils each. He gives away 5 pencils. How many pencils does he have now?", "answer": "#### 19"},
    {"question": "A ticket costs $7. How much do 6 tickets cost if there is a $4 discount on the total?", "answer": "#### 38"},
]


def gsm8k_questions(n: int, path: Path = DEFAULT_GSM8K) -> list[dict]:
    """The first ``n`` GSM8K dev problems (built-in ones when the data folder is absent)."""
    if not path.is_file():
        return BUILTIN_GSM8K[:n]
    with path.open() as handle:
        return [json.loads(line) for line, _ in zip(handle, range(n))]


def debate_messages(k: int, agents: int, question: str, replies: list[str]) -> list[dict]:
    """Solver ``k``'s prompt in a fully connected debate: its own system text, the question, and
    every earlier solver's reply pasted verbatim (the KVCOMM paper's GSM8K setting)."""
    system = (f"You are solver {k} of {agents} in a team solving a math word problem. Reason step "
              "by step, check the other solvers' answers, and end with the final number.")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    for j, reply in enumerate(replies, start=1):
        messages.append({"role": "user", "content": f"Solver {j} answered:\n{reply}"})
    return messages


def last_number(text: str) -> str | None:
    """The last number in a text (how GSM8K answers are scored), commas and a final dot removed."""
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def gold_answer(row: dict) -> str | None:
    """The gold number of a GSM8K row (after '####')."""
    return last_number(row["answer"].split("####")[-1])


# ---- HumanEval ------------------------------------------------------------------------------
BUILTIN_PROBLEMS = [{
    "name": "builtin_count_vowels", "entry_point": "count_vowels",
    "prompt": 'def count_vowels(text: str) -> int:\n    """Return how many of the characters of text are vowels (a, e, i, o, u, either case).\n    >>> count_vowels("Agent")\n    2\n    """\n',
    "test": "assert count_vowels('Agent') == 2\nassert count_vowels('') == 0\nassert count_vowels('xyz') == 0\n",
}]


def load_problems(n: int, path: Path = DEFAULT_HUMANEVAL) -> list[dict]:
    """The first ``n`` HumanEval-style problems (a built-in one when the data folder is absent)."""
    if not path.is_file():
        return BUILTIN_PROBLEMS[:n]
    with path.open() as handle:
        return [json.loads(line) for line, _ in zip(handle, range(n))]


# ---- documentation pages (offline, rendered by pydoc) ---------------------------------------
def stdlib_doc(dotted: str, max_chars: int = 1800) -> str:
    """Plain-text pydoc of a standard-library object, capped at ``max_chars``, without the memory
    addresses of default values' reprs (``<... object at 0x7f...>``: they change from process
    to process, and a benchmark's prompts must not). (The text depends on the Python version:
    compare runs made with the same interpreter.)"""
    module_name, *attrs = dotted.split(".")
    obj = importlib.import_module(module_name)
    for attr in attrs:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            obj = importlib.import_module(f"{obj.__name__}.{attr}")
    text = pydoc.render_doc(obj, title=f"Documentation of {dotted}:\n%s", renderer=pydoc.plaintext)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)[:max_chars].rstrip()
