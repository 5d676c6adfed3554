"""``python -m benchmarks``: every strategy side by side, speed and fidelity, in one run.

Phases (each resumable: a finished phase with the same settings is loaded, not rerun; dense
replies are cached request by request):

- ``a``: (a) the paper's TTFT shape, forced protocol, every strategy.
- ``b``: (b) GSM8K debate, forced protocol, every strategy; on its first questions also the
  noise floor (dense bf16) and KVCOMM (mean) at every other gamma.
- ``b-gamma``: the gamma sweep, read from phase ``b`` (runs it if needed): dense, re-rotation
  only and KVCOMM (mean) at each gamma on the same first questions.
- ``b-e2e``: (b) end to end (each strategy feeds itself): re-rotation only and KVCOMM against
  the dense pipeline (the cached dense replies).
- ``c``: (c) RAG hand-off, forced protocol. ``d``: (d) HumanEval pipeline, forced protocol.

    python -m benchmarks [--profile quick|default|smoke|gpu] [--model embedded|random:<shape>|PATH]
                         [--phases a,b,...] [--strategies dense,...] [--gamma 0.3] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from . import measure, report
from .models import load
from .strategies import DEFAULT_NAMES, NAMES, Strategy, build, known, noise_floor
from .workloads import Workload, coding_pipeline, gsm8k_debate, gsm8k_one_message, paper_shape, rag_handoff, shared_history


@dataclass(frozen=True)
class Profile:
    """Sample sizes of one run. ``a_*``: workload (a); ``b_*``: (b); warm-up requests come first
    and are not measured."""

    name: str
    reply_tokens: int = 128
    a_agents: int = 5
    a_lead: int = 256
    a_input: int = 512
    a_reply: int = 128
    a_warmup: int = 3
    a_requests: int = 5
    b_agents: int = 4
    b_warmup: int = 5
    b_requests: int = 40
    noise_requests: int = 10  # the bf16 noise floor, on the first measured questions of (b)
    e2e_warmup: int = 0
    e2e_requests: int = 20
    e2e_reply_tokens: int = 128
    gamma_values: tuple = (0.1, 0.3, 0.9)
    gamma_requests: int = 10  # the first measured questions of (b)
    c_warmup: int = 2
    c_requests: int = 10
    d_warmup: int = 2
    d_requests: int = 10
    e_warmup: int = 3
    e_requests: int = 6
    f_warmup: int = 2
    f_requests: int = 4

    def describe(self) -> str:
        return (f"profile {self.name}: replies <= {self.reply_tokens} tokens; (a) N={self.a_agents} P={self.a_lead} "
                f"I={self.a_input} O={self.a_reply}, {self.a_warmup} warm-up + {self.a_requests} measured requests; "
                f"(b) {self.b_agents} solvers, {self.b_warmup} warm-up + {self.b_requests} questions (fidelity; "
                f"noise floor on the first {self.noise_requests}), "
                f"{self.e2e_warmup} + {self.e2e_requests} end to end (replies <= {self.e2e_reply_tokens}), gamma {list(self.gamma_values)} on the first "
                f"{self.gamma_requests} of (b); (c) {self.c_warmup} + {self.c_requests}; "
                f"(d) {self.d_warmup} + {self.d_requests}; (e) {self.e_warmup} + {self.e_requests}; "
                f"(f) {self.f_warmup} + {self.f_requests}")


PROFILES = {
    "default": Profile("default"),
    "quick": Profile("quick", reply_tokens=64, a_agents=4, a_lead=128, a_input=256, a_reply=64, a_warmup=3,
                     a_requests=3, b_warmup=4, b_requests=6, noise_requests=3, e2e_warmup=1, e2e_requests=3, e2e_reply_tokens=32, gamma_values=(0.1, 0.9),
                     gamma_requests=4, c_warmup=2, c_requests=2, d_warmup=2, d_requests=2, e_warmup=3, e_requests=3,
                     f_warmup=2, f_requests=2),
    "smoke": Profile("smoke", reply_tokens=8, a_agents=3, a_lead=24, a_input=48, a_reply=8, a_warmup=1,
                     a_requests=1, b_agents=3, b_warmup=1, b_requests=2, noise_requests=1, e2e_warmup=0, e2e_requests=1, e2e_reply_tokens=8,
                     gamma_values=(0.1, 0.3), gamma_requests=1, c_warmup=0, c_requests=1, d_warmup=0, d_requests=1,
                     e_warmup=0, e_requests=1, f_warmup=0, f_requests=1),
    # the paper's shape on one GPU (benchmarks/gpu_check.sh): TTFT only, replies generated once
    "gpu": Profile("gpu", a_agents=5, a_lead=512, a_input=1024, a_reply=512, a_warmup=2, a_requests=2,
                   noise_requests=0),
}
PHASES = ("a", "b", "b-gamma", "c", "d", "e", "f", "b-e2e")
#: dense replies shipped with the checkout (``<model tag>/<dtype>-<device>/<workload>.json``):
#: the default profile's, for the embedded model on a CPU, so that a fresh checkout does not
#: spend 23 minutes regenerating them (regenerated, they are identical: see
#: docs/benchmarks.md); ``--no-seed-replies`` ignores them
SEED_REPLIES = Path(__file__).parent / "replies"
E2E_STRATEGIES = ("dense", "rerotate", "kvcomm-mean", "kvcomm-unframed")


@dataclass
class Context:
    """What every phase needs."""

    args: argparse.Namespace
    profile: Profile
    loaded: object
    out: Path
    eos_ids: set = field(default_factory=set)
    device: str = "cpu"
    done: dict = field(default_factory=dict)  # phase -> saved dict, within this invocation


def versions(device: torch.device) -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": str(device), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _fingerprint(workload: Workload) -> None:
    """Make request keys name their content, so cached replies never go stale."""
    for request in workload.requests:
        text = json.dumps([request.messages(0, []), request.agents, workload.reply_tokens, workload.exact_replies])
        request.key = f"{request.key}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"


def _strategies(ctx: Context, names, **kw) -> list[Strategy]:
    m = ctx.loaded
    return [build(n, m.model, m.tokenizer, gamma=kw.get("gamma", ctx.args.gamma),
                  recompute_share=ctx.args.recompute_share) for n in names]


def _progress(total: int, desc: str, unit: str = "call"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stdout, dynamic_ncols=True, mininterval=2.0)


def _refs(ctx: Context, workload: Workload) -> dict:
    _fingerprint(workload)
    where = f"{ctx.args.dtype}-{ctx.device}"
    path = ctx.out.parent / "refs" / where / f"{workload.name}.pt"
    seed = None if ctx.args.no_seed_replies else SEED_REPLIES / ctx.loaded.tag / where / f"{workload.name}.json"
    bar = _progress(len(workload.requests), f"dense replies {workload.name}", unit="request")
    refs = measure.references(workload, ctx.loaded.model, ctx.loaded.tokenizer, path, progress=bar.update, seed=seed)
    bar.close()
    return refs


def _workload(ctx: Context, phase: str) -> tuple[Workload, int]:
    p, tok = ctx.profile, ctx.loaded.tokenizer
    if phase == "a":
        return paper_shape(tok, requests=p.a_warmup + p.a_requests, agents=p.a_agents, lead_tokens=p.a_lead,
                           input_tokens=p.a_input, reply_tokens=p.a_reply), p.a_warmup
    if phase == "b":
        return gsm8k_debate(requests=p.b_warmup + p.b_requests, agents=p.b_agents, reply_tokens=p.reply_tokens), p.b_warmup
    if phase == "b-e2e":
        return gsm8k_debate(requests=p.e2e_warmup + p.e2e_requests, agents=p.b_agents,
                            reply_tokens=p.e2e_reply_tokens), p.e2e_warmup
    if phase == "c":
        return rag_handoff(requests=p.c_warmup + p.c_requests, reply_tokens=p.reply_tokens), p.c_warmup
    if phase == "d":
        return coding_pipeline(requests=p.d_warmup + p.d_requests, reply_tokens=p.reply_tokens), p.d_warmup
    if phase == "e":
        return gsm8k_one_message(requests=p.e_warmup + p.e_requests, agents=p.b_agents,
                                 reply_tokens=p.reply_tokens), p.e_warmup
    if phase == "f":
        return shared_history(requests=p.f_warmup + p.f_requests, reply_tokens=p.reply_tokens), p.f_warmup
    raise ValueError(f"unknown phase '{phase}'; known: {', '.join(PHASES)}")


_PHASE_FIELDS = {"a": ("a_",), "b": ("b_", "reply_tokens", "noise_", "gamma_"), "b-e2e": ("b_agents", "e2e_"),
                 "c": ("c_", "reply_tokens"), "d": ("d_", "reply_tokens"), "e": ("e_", "b_agents", "reply_tokens"),
                 "f": ("f_", "reply_tokens")}


def _relevant(profile: dict, phase: str) -> dict:
    """The profile fields a phase depends on: changing another phase's sample size keeps it."""
    return {k: v for k, v in profile.items() if k.startswith(_PHASE_FIELDS[phase])}


def run_phase(ctx: Context, phase: str) -> dict:
    """Run (or load, if finished with the same settings) one phase; returns its saved dict."""
    if phase == "b-gamma":
        return gamma_sweep(ctx, ctx.done.get("b") or run_phase(ctx, "b"))
    workload, warmup = _workload(ctx, phase)
    names = list(ctx.args.strategies)
    if phase == "b-e2e":
        names = [n for n in names if n in E2E_STRATEGIES]
    signature = {"phase": phase, "model": ctx.loaded.spec, "dtype": ctx.args.dtype, "device": ctx.device,
                 "profile": _relevant(asdict(ctx.profile), phase),
                 "strategies": names, "gamma": ctx.args.gamma, "recompute_share": ctx.args.recompute_share}
    if phase == "b-e2e" and ctx.args.e2e_timed:
        signature["e2e_timed"] = True
    if phase == "b-e2e" and ctx.args.e2e_noise_floor:
        signature["e2e_noise_floor"] = True
    signature = json.loads(json.dumps(signature))  # as it reads back (tuples become lists)
    path = ctx.out / f"phase_{phase}.json"
    if path.is_file() and not ctx.args.fresh:
        saved = json.loads(path.read_text())
        old = saved.get("signature", {})
        if {"device": "cpu", **old, "profile": _relevant(old.get("profile", {}), phase)} == signature:
            print(f"phase {phase}: finished earlier, loaded {path}")
            ctx.done[phase] = saved
            return saved
    started = time.perf_counter()
    calls = sum(len(r.agents) for r in workload.requests)
    answers: list[dict] = []
    if phase == "b-e2e":
        # the dense pipeline is the dense replies every forced phase uses (greedy, batched):
        # decoding them again unbatched would double this phase's time; --e2e-timed decodes it
        # too, and runs the pipelines in turns so that their wall times are comparable
        refs = _refs(ctx, workload)
        timed = ctx.args.e2e_timed
        strategies = _strategies(ctx, names if timed else [n for n in names if n != "dense"])
        if ctx.args.e2e_noise_floor:  # the dense pipeline in bf16: the drift that is not reuse's
            strategies.append(noise_floor(ctx.loaded.model, ctx.loaded.tokenizer))
        bar = _progress(calls * len(strategies), f"{phase} ({len(strategies)} strategies + dense replies)")
        # otherwise answers, not speed: on a CPU the pipelines run side by side, one thread each
        records, answers = measure.run_end_to_end(workload, strategies, warmup=warmup, phase=phase, refs=refs,
                                                  concurrent=ctx.device == "cpu" and not timed, progress=bar.update)
    else:
        refs = _refs(ctx, workload)
        strategies = _strategies(ctx, names) + (_subset_strategies(ctx, names) if phase == "b" else [])
        bar = _progress(calls, f"{phase} ({len(strategies)} strategies)")
        partial = ctx.out / f"phase_{phase}.partial.json"
        records = measure.run_forced(
            workload, strategies, refs, warmup=warmup, eos_ids=ctx.eos_ids, phase=phase, progress=bar.update,
            checkpoint=lambda so_far: measure.write_json({"signature": signature, "records": so_far}, partial),
            tokenizer=ctx.loaded.tokenizer,
        )
        partial.unlink(missing_ok=True)
    bar.close()
    saved = {"signature": signature, "title": workload.title, "elapsed_s": time.perf_counter() - started,
             "requests": {"warmup": warmup, "measured": len(workload.requests) - warmup},
             "records": [r for r in records if "gamma=" not in r["strategy"]], "answers": answers,
             "gamma_records": [r for r in records if "gamma=" in r["strategy"]],
             "concurrent": any(r.get("concurrent") for r in records)}
    path.write_text(json.dumps(saved))
    print(f"phase {phase}: {saved['elapsed_s']:.0f} s, written {path}")
    ctx.done[phase] = saved
    return saved


def _subset_strategies(ctx: Context, names: list[str]) -> list[Strategy]:
    """The rows of (b) measured on its first questions only, in the same run (paired with the
    same dense calls): the bf16 noise floor, and KVCOMM (mean) at every other gamma (its pools
    filled by the same warm-up questions)."""
    m, p = ctx.loaded, ctx.profile
    extra: list[Strategy] = []
    if p.noise_requests:
        # from the last warm-up question on: its one call pays the bf16 start-up
        start = max(0, p.b_warmup - 1)
        extra.append(noise_floor(m.model, m.tokenizer, requests=range(start, p.b_warmup + p.noise_requests)))
    if "kvcomm-mean" in names:
        for gamma in p.gamma_values:
            if gamma != ctx.args.gamma:
                strategy = build("kvcomm-mean", m.model, m.tokenizer, gamma=gamma)
                strategy.name = f"kvcomm-mean(gamma={gamma:g})"
                strategy.requests = range(p.b_warmup + p.gamma_requests)
                extra.append(strategy)
    return extra


def gamma_sweep(ctx: Context, b: dict) -> dict:
    """The gamma sweep, taken from phase (b)'s run: dense, re-rotation only and KVCOMM (mean) at
    the run's gamma on the first questions, with the other gammas measured there alongside."""
    p = ctx.profile
    stop = p.b_warmup + p.gamma_requests
    renamed = {"dense": "dense", "rerotate": "rerotate", "kvcomm-mean": f"kvcomm-mean(gamma={ctx.args.gamma:g})"}
    records = [{**r, "phase": "b-gamma", "strategy": renamed[r["strategy"]]}
               for r in b["records"] if r["request"] < stop and r["strategy"] in renamed]
    records += [{**r, "phase": "b-gamma"} for r in b.get("gamma_records", [])]
    return {"signature": b["signature"], "title": b["title"], "elapsed_s": 0.0,
            "requests": {"warmup": p.b_warmup, "measured": min(p.gamma_requests, b["requests"]["measured"])},
            "records": records, "answers": [], "derived_from": "b"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    parser.add_argument("--quick", action="store_const", const="quick", dest="profile", help="same as --profile quick")
    parser.add_argument("--model", default="embedded", help="embedded | random:<shape> | a local model folder")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--strategies", default=",".join(DEFAULT_NAMES),
                        help=f"comma-separated, of: {', '.join(NAMES)}; an engine strategy + '-head-N' recomputes the "
                             "first N tokens of each reused run, + '-spread-P' the P%% of estimated tokens whose "
                             "anchors disagree most")
    parser.add_argument("--gamma", type=float, default=0.3, help="entropy-gate threshold of the KVCOMM strategies")
    parser.add_argument("--recompute-share", type=float, default=0.15, help="CacheBlend-style share recomputed")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--e2e-timed", action="store_true",
                        help="end to end: decode the dense pipeline too and run the pipelines in turns, "
                             "reporting each pipeline's wall time (prefill and decode)")
    parser.add_argument("--e2e-noise-floor", action="store_true",
                        help="end to end: also run the dense pipeline in bf16 (the end-to-end noise floor; "
                             "several times slower than fp32 on a CPU)")
    parser.add_argument("--fresh", action="store_true", help="rerun finished phases (cached dense replies are kept)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-seed-replies", action="store_true",
                        help="generate every dense reply instead of taking the ones shipped in benchmarks/replies/")
    args = parser.parse_args(argv)
    args.phases = [p for p in args.phases.split(",") if p]
    args.strategies = [s for s in args.strategies.split(",") if s]
    for name in args.strategies:
        if not known(name):
            parser.error(f"unknown strategy '{name}'; known: {', '.join(NAMES)}, or an engine strategy + '-head-N' / '-spread-P'")
    if "dense" not in args.strategies:
        parser.error("the dense strategy is the reference and must be included")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if args.model.startswith("random:") and args.model != "random:tiny" and device.type != "cuda":
        raise SystemExit("random:<shape> models are full size: run them on a GPU (random:tiny runs anywhere)")
    profile = PROFILES[args.profile]
    info = versions(device)
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    print(profile.describe(), flush=True)
    torch.manual_seed(0)
    loaded = load(args.model, device=str(device), dtype=getattr(torch, args.dtype))
    out = args.out / loaded.tag / profile.name
    out.mkdir(parents=True, exist_ok=True)
    from kvcomm_agents.support import inspect_model

    info_eos = inspect_model(loaded.model, loaded.tokenizer, reuse=False).eos_ids
    ctx = Context(args, profile, loaded, out, set(info_eos), device.type)
    print(f"model {args.model} ({loaded.tag}), {args.dtype}, strategies: {', '.join(args.strategies)}; output {out}",
          flush=True)
    results = {"versions": info, "profile": asdict(profile), "model": args.model, "dtype": args.dtype, "phases": {}}
    all_records, rows = [], []
    for phase in args.phases:
        saved = run_phase(ctx, phase)
        phase_rows = report.summarize(saved["records"])
        rows += phase_rows
        all_records += saved["records"]
        results["phases"][phase] = {"title": saved["title"], "requests": saved["requests"],
                                    "elapsed_s": saved["elapsed_s"], "answers": report.summarize_answers(saved["answers"]),
                                    "concurrent": saved.get("concurrent", False)}
        if phase in ("b", "c", "d", "e", "f"):  # replies generated freely (not (a)'s exact-length ones)
            results["phases"][phase]["dense_follows_references"] = report.dense_follows_references(saved["records"])
        results["phases"][phase]["warmup_cost"] = report.warmup_cost(saved["records"])
        if phase == "b-e2e" and not saved.get("concurrent"):
            results["phases"][phase]["pipeline_wall"] = measure.pipeline_wall_times(saved["records"])
        results["rows"] = rows
        (out / "results.json").write_text(json.dumps(results, indent=1))
    for phase in args.phases:
        report.print_phase(phase, results["phases"][phase]["title"], rows, per_agent=phase == "a",
                           timed=not results["phases"][phase]["concurrent"])
        for name, wall in (results["phases"][phase].get("pipeline_wall") or {}).items():
            ratio = "-" if wall["speedup_vs_dense"] is None else f"{wall['speedup_vs_dense']:.2f}x"
            print(f"  end to end {name:<14} wall time per pipeline (prefill + decode, median of "
                  f"{wall['requests']}): {wall['median_s']:.1f} s, {ratio} dense")
        cost = results["phases"][phase].get("warmup_cost") or {}
        if cost:
            print("  warm-up cost (requests until every later request reuses >= 90% of its eligible calls): "
                  + ", ".join(f"{name} {'not reached' if n is None else n}" for name, n in cost.items()))
        follows = results["phases"][phase].get("dense_follows_references") or {}
        if follows.get("calls"):
            print(f"  dense (engine, unbatched) follows the batched dense replies: whole reply in "
                  f"{100 * follows['whole_reply']:.0f}% of {follows['calls']} calls, "
                  f"{100 * follows['token_share']:.0f}% of reply tokens before a departure")
        if results["phases"][phase]["answers"] and not results["phases"][phase].get("pipeline_wall"):
            print("  end to end: the dense pipeline is the cached dense replies (greedy, batched); see the "
                  "'follows' line of (b) for how closely the unbatched dense engine reproduces them")
        for answer in results["phases"][phase]["answers"]:
            accuracy = "-" if answer["accuracy"] is None else f"{100 * answer['accuracy']:.0f}%"
            print(f"  end to end {answer['strategy']:<14} final answer = dense "
                  f"{100 * answer['final_equal_to_dense']:.0f}%  accuracy {accuracy}  ({answer['requests']} requests)")
    print("\n" + report.LEGEND)
    if not args.no_plots:
        try:
            results["plots"] = [str(p) for p in make_plots(rows, all_records, results, out / "plots")]
            print("plots: " + ", ".join(results["plots"]))
        except ImportError as error:  # GPU machines may lack matplotlib: the JSON holds every figure
            print(f"plots skipped ({error}); pip install 'kvcomm-agents[bench]'")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"written {out / 'results.json'}")
    return results


def make_plots(rows: list[dict], records: list[dict], results: dict, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for phase in ("a", "b", "c", "d", "e", "f"):
        if phase in results["phases"]:
            made.append(report.plot_ttft_by_agent(rows, phase, results["phases"][phase]["title"],
                                                  folder / f"ttft_by_agent_{phase}.png"))
    forced = [r for r in records if r["phase"] in ("a", "b", "c", "d", "e", "f")]
    if forced:
        made.append(report.plot_speedup_vs_length(forced, folder / "speedup_vs_prompt_length.png"))
    gamma_rows = [r for r in rows if r["phase"] == "b-gamma" and r["agent"] == report.DOWNSTREAM]
    if gamma_rows:
        points = []
        for r in gamma_rows:
            gamma: Optional[float] = None
            if "gamma=" in r["strategy"]:
                gamma = float(r["strategy"].split("gamma=")[1].rstrip(")"))
            elif r["strategy"] == "dense":
                continue
            points.append({"label": r["strategy"], "gamma": gamma, "reuse_rate": r["reuse_rate"], "kl_mean": r["kl_mean"]})
        made.append(report.plot_gamma_sweep(points, folder / "kl_vs_reuse_gamma.png"))
    return made
