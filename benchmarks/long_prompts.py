"""Long prompts: peak memory and time of one call with reuse against dense, at 4k-32k tokens.

Each configuration runs in its own process (so peaks do not mix), on a tiny Llama by default
(``--model tiny``: 4 layers, fast enough for 32k tokens on a laptop CPU; the masks, the cache
copies and attention's share of the time are what is measured) or on the embedded SmolLM2-135M
(``--model embedded``: the realistic mix, about 15 s per 2k tokens on 2 CPU cores), each with its
position limit raised to fit the prompt (RoPE extends; the figures are about memory and time, not
answer quality). The prompt is GSM8K text as one long document in two user messages with a
registered shared text (``engine.add_segment``) between them, so the reuse call re-rotates that
text into the middle of the prompt and must keep every earlier token from seeing it.

Modes:
- ``dense``: ``reuse=False``, one forward with the model's own causal mask;
- ``reuse``: the engine as shipped (position-ordered windows once the mask would exceed
  ``engines.hf.MASK_BUDGET`` elements);
- ``reuse-one-mask``: the same call with the budget lifted, i.e. one forward with a full
  query x key float mask (the behaviour before windows; skipped where it would not fit).

Peak memory is the process's resident high-water mark (``VmHWM``, reset just before the call)
minus its resident size then.

    python -m benchmarks.long_prompts [--model tiny|embedded] [--lengths 4096 16384 32768]
                                      [--out benchmarks/out/long_prompts.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["measure_one"]

MODES = ("dense", "reuse", "reuse-one-mask")
SHARED = ("Shared note from the planner: check each quantity twice, keep units in every line, and "
          "state the final number on its own line after the words 'The answer is'.")
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k-dev.jsonl"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _filler(tokenizer, tokens: int) -> tuple[str, str]:
    """Two halves of a document of about ``tokens`` tokens, made of GSM8K questions."""
    questions = [json.loads(line)["question"] for line in DATA.read_text().splitlines() if line.strip()]
    text: list[str] = []
    while len(tokenizer("\n".join(text), add_special_tokens=False)["input_ids"]) < tokens:
        start = len(text)
        text += [questions[(start + j) % len(questions)] for j in range(20)]
    ids = tokenizer("\n".join(text), add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids[: tokens // 2]).strip(), tokenizer.decode(ids[tokens // 2:]).strip()


def _load(which: str, positions: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcomm_agents.embedded import embedded_model_dir
    from kvcomm_agents.testing import tiny_llama, tiny_tokenizer

    if which == "tiny":
        tokenizer = tiny_tokenizer()
        return tiny_llama(tokenizer, max_position_embeddings=positions).eval(), tokenizer
    source = embedded_model_dir()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, max_position_embeddings=positions)
    return model.eval(), AutoTokenizer.from_pretrained(source)


def measure_one(tokens: int, mode: str, which: str = "tiny", shared: str = "note") -> dict:
    """One call of ``mode`` on a prompt of about ``tokens`` tokens, in this process."""
    from kvcomm_agents import KVCommConfig, KVCommEngine
    from kvcomm_agents.engines import hf

    model, tokenizer = _load(which, tokens + 512)
    engine = KVCommEngine(model, tokenizer, config=KVCommConfig(method="rerotate"))
    first, second = _filler(tokenizer, tokens)
    engine.add_segment(SHARED if shared == "note" else first)
    messages = [{"role": "system", "content": "You answer questions about the document."},
                {"role": "user", "content": first}, {"role": "user", "content": SHARED},
                {"role": "user", "content": second + "\nWhat is the first question about?"}]
    engine.chat(messages[:1] + [{"role": "user", "content": SHARED}], agent="reader", max_new_tokens=1, reuse=False)
    if mode == "reuse-one-mask":
        hf.MASK_BUDGET = 1 << 62
    with open("/proc/self/clear_refs", "w") as handle:  # reset the resident high-water mark
        handle.write("5")
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    result = engine.chat(messages, agent="reader", max_new_tokens=1, reuse=mode != "dense")
    wall = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    stats = result.stats
    return {"model": which, "shared": shared, "tokens": stats.prompt_tokens, "mode": mode, "reused_tokens": stats.reused_tokens,
            "extra_peak_mib": (peak - before) / 1024, "ttft_s": stats.ttft_s, "prefill_s": stats.prefill_s,
            "align_s": stats.align_s, "wall_s": wall, "dense_reason": stats.dense_reason}


def _fits(tokens: int, mode: str, free_gib: float) -> bool:
    """The one-mask mode needs a float32 query x key mask plus SDPA's copy of it."""
    return mode != "reuse-one-mask" or 2 * 4 * tokens * tokens / 2**30 < 0.6 * free_gib


def _free_gib() -> float:
    with open("/proc/meminfo") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    return int(fields["MemAvailable"].split()[0]) / 2**20


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "embedded"), default="tiny")
    parser.add_argument("--shared", choices=("note", "half"), nargs="+", default=["note", "half"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/long_prompts.json"))
    parser.add_argument("--child", nargs=2, metavar=("TOKENS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure_one(int(args.child[0]), args.child[1], args.model, args.shared[0])))
        return
    rows = []
    print(f"model: {args.model}")
    print(f"{'shared':<6} {'tokens':>7} {'mode':<15} {'reused':>6} {'extra peak MiB':>14} {'TTFT s':>8} {'vs dense':>9}")
    for shared in args.shared:
        for tokens in args.lengths:
            dense_ttft = None
            for mode in args.modes:
                if not _fits(tokens, mode, _free_gib()):
                    print(f"{shared:<6} {tokens:>7} {mode:<15} skipped: its mask would not fit in memory")
                    continue
                done = subprocess.run([sys.executable, "-m", "benchmarks.long_prompts", "--model", args.model,
                                       "--shared", shared, "--child", str(tokens), mode],
                                      capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{shared:<6} {tokens:>7} {mode:<15} failed: {done.stderr.strip().splitlines()[-1:]}")
                    rows.append({"shared": shared, "tokens": tokens, "mode": mode, "failed": done.stderr[-2000:]})
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                dense_ttft = row["ttft_s"] if mode == "dense" else dense_ttft
                ratio = f"{row['ttft_s'] / dense_ttft:8.2f}x" if dense_ttft else ""
                print(f"{shared:<6} {row['tokens']:>7} {mode:<15} {row['reused_tokens']:>6} "
                      f"{row['extra_peak_mib']:>14.0f} {row['ttft_s']:>8.2f} {ratio:>9}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "lengths": args.lengths, "rows": rows}, indent=1))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
