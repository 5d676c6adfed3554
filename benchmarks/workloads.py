"""Workloads shared by the evaluation scripts: defined once, fed identically to every strategy."""

from __future__ import annotations

import json
import re
from pathlib import Path

DEFAULT_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k-dev.jsonl"
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
