"""``python -m benchmarks``: every strategy side by side on whole graphs, in one run.

Each phase is one workload run under the whole-graph protocol (:mod:`benchmarks.graph`): per
request and strategy, the graph's wall time, the tokens forwarded through the model and each
reader's time to first token, fidelity against dense on the same ids, on the workload's report
range (:mod:`benchmarks.workloads`). Phases ``a``-``j`` are the workloads of that name; ``b-e2e``
runs (b) end to end (each strategy feeding itself, the dense pipeline run too): final answers.

A finished phase is reloaded only when its signature (commit, library versions, settings and
every agent's prompt) is unchanged; ``--fresh`` reruns it.

    python -m benchmarks [--profile quick|default|smoke|gpu|graphs|long-replies] [--model embedded|random:<shape>|PATH]
                         [--phases a,b,...] [--strategies dense,...] [--split report|dev] [--out DIR]
                         [--weight-layout measured|as_loaded|transposed]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvcomm_agents.engines.weight_layout import choose_layout, pin_layout

from . import measure, report
from .graph import ModelMeter, run_graph
from .graph_report import (fastest_and_closest, noise_floor_readers, summarize_by_format, summarize_decisions,
                           summarize_graphs)
from .graph_tables import GRAPH_LEGEND, phase_console
from .models import TINY, load
from .provenance import git_commit, versions
from .strategies import DEFAULT_NAMES, NAMES, Strategy, build, known, noise_floor
from .workloads import (Workload, changing_graph, coding_pipeline, fan_out, gsm8k_debate, gsm8k_one_message,
                        long_document, paper_shape, prompt_formats, rag_handoff, shared_history)

GRAPH_PHASES = ("a", "b", "c", "d", "e", "f", "g", "h", "i", "j")
DECIDING_PHASES = ("b", "i")  # the last agent decides: judge consistency
DECISION_STRATEGIES = ("dense", "rerotate", "kvcomm-mean")
PHASES = GRAPH_PHASES + ("b-e2e",)
E2E_STRATEGIES = ("dense", "rerotate", "kvcomm-mean", "kvcomm-copies")


@dataclass(frozen=True)
class Profile:
    """Sample sizes of one run: per phase, (warm-up requests, measured requests); warm-up
    requests fill stores and anchor pools and are not measured."""

    name: str
    reply_tokens: int = 64  # replies of (b)-(g) and (i) at most; (h)'s at most 32
    sizes: dict = field(default_factory=dict)
    a_shape: tuple = (5, 256, 512, 64)  # (a): agents N, own text P, shared input I, reply O tokens
    h_reply_tokens: int = 32
    #: deciding phases ((b), (i)) with the bf16 noise floor on the decider's call of every
    #: measured request
    noise_floor: tuple = ()
    #: (b) and (i): measured requests after the sizes' on which only the decision strategies run
    #: (judge consistency needs 20+ requests; whole-graph rows use the requests every strategy ran)
    decision_requests: int = 0
    e2e_requests: int = 20
    e2e_reply_tokens: int = 64

    def describe(self) -> str:
        sizes = ", ".join(f"({p}) {w}+{n}" for p, (w, n) in self.sizes.items())
        return (f"profile {self.name}: replies <= {self.reply_tokens} tokens ((h) <= {self.h_reply_tokens}); (a) "
                f"N={self.a_shape[0]} P={self.a_shape[1]} I={self.a_shape[2]} O={self.a_shape[3]}; warm-up + "
                f"measured requests: {sizes}, and {self.decision_requests} more on (b) and (i) for "
                f"{', '.join(DECISION_STRATEGIES)} and the ablations named only; bf16 noise floor on the decider's "
                f"calls of {', '.join(f'({p})' for p in self.noise_floor) or 'none'}; end to end "
                f"{self.e2e_requests} requests (replies <= {self.e2e_reply_tokens})")


#: the default profile's (warm-up, measured) requests per phase
DEFAULT_SIZES = {"a": (2, 2), "b": (2, 4), "c": (2, 4), "d": (2, 4), "e": (2, 4), "f": (2, 2), "g": (2, 4), "h": (1, 3),
                 "i": (2, 3), "j": (2, 6)}

PROFILES = {
    "default": Profile("default", reply_tokens=32, a_shape=(5, 256, 512, 32),
                       sizes=DEFAULT_SIZES,
                       noise_floor=("b", "i"), decision_requests=17, e2e_reply_tokens=32),
    "quick": Profile("quick", reply_tokens=16, h_reply_tokens=16, a_shape=(4, 128, 256, 16),
                     sizes={p: (1, 1) for p in GRAPH_PHASES}, e2e_requests=3, e2e_reply_tokens=16),
    "smoke": Profile("smoke", reply_tokens=4, h_reply_tokens=4, a_shape=(3, 24, 48, 4),
                     sizes={p: (1, 1) for p in GRAPH_PHASES}, e2e_requests=1, e2e_reply_tokens=4),
    # the default's graphs without (b) and (i)'s decision-only requests: whole-graph rows alone
    "graphs": Profile("graphs", reply_tokens=32, a_shape=(5, 256, 512, 32),
                      sizes=DEFAULT_SIZES, e2e_reply_tokens=32),
    # replies as long as a reasoning agent's (the other profiles cut them to 32 tokens, below the
    # 64-token short-text rule): what reuse of long replies gives and costs; (h) is the
    # prefill-heavy graph by definition, its notes stay short
    "long-replies": Profile("long-replies", reply_tokens=160, a_shape=(5, 256, 512, 160),
                            sizes={p: (1, 3) for p in GRAPH_PHASES}, e2e_reply_tokens=160),
    # the paper's shape on one GPU (benchmarks/gpu_check.sh), replies cut to 64 tokens so that
    # every strategy's whole graph fits the check's few minutes
    "gpu": Profile("gpu", a_shape=(5, 512, 1024, 64), sizes={"a": (1, 2)}),
}


@dataclass
class Context:
    """What every phase needs."""

    args: argparse.Namespace
    profile: Profile
    loaded: object
    out: Path
    eos_ids: set = field(default_factory=set)
    device: str = "cpu"
    meter: ModelMeter = None


def prompts_digest(workload: Workload) -> str:
    """A digest of every agent's prompt of every request (replies stood in by their index)."""
    text = json.dumps([[request.messages(k, [f"<reply {j}>" for j in range(k)]) for k in range(len(request.agents))]
                       for request in workload.requests], default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def _strategies(ctx: Context, names) -> list[Strategy]:
    m = ctx.loaded
    remembered = None if ctx.args.remembered is None else str(ctx.args.remembered)
    return [build(n, m.model, m.tokenizer, gamma=ctx.args.gamma, recompute_share=ctx.args.recompute_share,
                  remembered=remembered) for n in names]


def _progress(total: int, desc: str, unit: str = "call"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stdout, dynamic_ncols=True, mininterval=2.0)


def _workload(ctx: Context, phase: str) -> tuple[Workload, int]:
    p, tok, split = ctx.profile, ctx.loaded.tokenizer, ctx.args.split
    warm, measured = p.sizes.get(phase, (0, 1)) if phase != "b-e2e" else (0, p.e2e_requests)
    if phase in DECIDING_PHASES and not ctx.args.cold:
        measured += p.decision_requests
    if ctx.args.cold:  # every request a graph's first: nothing to warm
        warm, measured = 0, warm + measured
    n, tokens = warm + measured, p.reply_tokens
    builders = {
        "a": lambda: paper_shape(tok, requests=n, agents=p.a_shape[0], lead_tokens=p.a_shape[1],
                                 input_tokens=p.a_shape[2], reply_tokens=p.a_shape[3], split=split),
        "b": lambda: gsm8k_debate(requests=n, reply_tokens=tokens, judge=True, split=split),
        "b-e2e": lambda: gsm8k_debate(requests=n, reply_tokens=p.e2e_reply_tokens, split=split),
        "c": lambda: rag_handoff(requests=n, reply_tokens=tokens, split=split),
        "d": lambda: coding_pipeline(requests=n, reply_tokens=tokens, split=split),
        "e": lambda: gsm8k_one_message(requests=n, reply_tokens=tokens, split=split),
        "f": lambda: shared_history(requests=n, reply_tokens=tokens, split=split),
        "g": lambda: changing_graph(requests=n, reply_tokens=tokens, split=split),
        "h": lambda: long_document(requests=n, reply_tokens=p.h_reply_tokens, split=split, tokenizer=tok),
        "i": lambda: fan_out(requests=n, reply_tokens=tokens, split=split),
        "j": lambda: prompt_formats(requests=n, reply_tokens=tokens, split=split),
    }
    if phase not in builders:
        raise ValueError(f"unknown phase '{phase}'; known: {', '.join(PHASES)}")
    return builders[phase](), warm


def run_phase(ctx: Context, phase: str) -> dict:
    """Run (or load, if finished with the same signature) one phase; returns its saved dict."""
    workload, warmup = _workload(ctx, phase)
    names = list(ctx.args.strategies)
    if phase == "b-e2e":
        names = [n for n in names if n in E2E_STRATEGIES]
    signature = {"phase": phase, "model": ctx.loaded.spec, "dtype": ctx.args.dtype, "versions": versions(
                 torch.device(ctx.device)), "profile": asdict(ctx.profile), "split": ctx.args.split,
                 "strategies": names, "gamma": ctx.args.gamma, "recompute_share": ctx.args.recompute_share,
                 "prompts": prompts_digest(workload), "e2e_timed": phase == "b-e2e" and ctx.args.e2e_timed,
                 "cold": ctx.args.cold, "remembered": None if ctx.args.remembered is None else str(ctx.args.remembered),
                 "weight_layout": ctx.args.layout}
    if phase in ctx.args.noise_floor:
        signature["noise_floor_readers"] = True
    signature = json.loads(json.dumps(signature))  # as it reads back (tuples become lists)
    path = ctx.out / f"phase_{phase}.json"
    if path.is_file() and not ctx.args.fresh:
        saved = json.loads(path.read_text())
        if saved.get("signature") == signature:
            print(f"phase {phase}: finished earlier with the same signature, loaded {path}")
            return saved
    started = time.perf_counter()
    calls = sum(len(r.agents) for r in workload.requests)
    if phase == "b-e2e":
        strategies = _strategies(ctx, names)
        bar = _progress(calls * len(strategies), f"{phase} ({len(strategies)} strategies)")
        # answers, not speed, unless timed: on a CPU the pipelines then run side by side, one thread each
        records, answers = measure.run_end_to_end(workload, strategies, warmup=warmup, phase=phase,
                                                  concurrent=ctx.device == "cpu" and not ctx.args.e2e_timed,
                                                  progress=bar.update)
    else:
        strategies = _strategies(ctx, names)
        if phase in DECIDING_PHASES and ctx.profile.decision_requests and not ctx.args.cold:
            everyone = range(len(workload.requests) - ctx.profile.decision_requests)
            for strategy in strategies:  # an ablation named is compared on the decisions too
                if strategy.name not in DECISION_STRATEGIES and strategy.name in DEFAULT_NAMES:
                    strategy.requests = everyone
        readers_floor = phase in ctx.args.noise_floor
        deciders_floor = phase in DECIDING_PHASES and phase in ctx.profile.noise_floor and not ctx.args.cold
        floors = []  # dense in another dtype: the drift that is not reuse's, same run (it learns nothing)
        if readers_floor or deciders_floor:
            floor = noise_floor(ctx.loaded.model, ctx.loaded.tokenizer, requests=range(warmup, len(workload.requests)))
            floor.decider_only = not readers_floor
            ctx.meter.watch(floor.engine.model)
            floors.append(floor)
        strategies += floors
        bar = _progress(calls, f"{phase} ({len(strategies)} strategies)")
        partial = ctx.out / f"phase_{phase}.partial.json"
        records, answers = run_graph(
            workload, strategies, warmup=warmup, phase=phase, tokenizer=ctx.loaded.tokenizer, eos_ids=ctx.eos_ids,
            meter=ctx.meter, progress=bar.update,
            checkpoint=lambda so_far: measure.write_json({"signature": signature, "records": so_far}, partial),
            renew=(lambda: _strategies(ctx, names) + floors) if ctx.args.cold else None)
        partial.unlink(missing_ok=True)
    bar.close()
    saved = {"signature": signature, "title": workload.title, "elapsed_s": time.perf_counter() - started,
             "requests": {"warmup": warmup, "measured": len(workload.requests) - warmup},
             "records": records, "answers": answers, "concurrent": any(r.get("concurrent") for r in records)}
    path.write_text(json.dumps(saved))
    print(f"phase {phase}: {saved['elapsed_s']:.0f} s, written {path}")
    return saved


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    parser.add_argument("--quick", action="store_const", const="quick", dest="profile", help="same as --profile quick")
    parser.add_argument("--model", default="embedded", help="embedded | random:<shape> | a local model folder")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--phases", default=",".join(GRAPH_PHASES))
    parser.add_argument("--split", choices=("report", "dev"), default="report",
                        help="the workloads' data range: report (what the docs quote) or dev (tuning, tracing)")
    parser.add_argument("--strategies", default=",".join(DEFAULT_NAMES),
                        help=f"comma-separated, dense first, of: {', '.join(NAMES)}; an engine strategy + '-head-N' "
                             "recomputes the first N tokens of each reused run, + '-short-N' computes approximate runs of "
                             "at most N tokens whole, '-tail-N' and '-last-N' set recompute_tail and recompute_last_run")
    parser.add_argument("--gamma", type=float, default=0.3, help="entropy-gate threshold of the KVCOMM strategies")
    parser.add_argument("--recompute-share", type=float, default=0.15, help="CacheBlend-style share recomputed")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--e2e-timed", action="store_true",
                        help="end to end: run the pipelines in turns (not side by side), so their wall times compare")
    parser.add_argument("--fresh", action="store_true", help="rerun finished phases")
    parser.add_argument("--cold", action="store_true",
                        help="every request on fresh strategies (nothing stored or learned): each one a graph's "
                             "first request, all measured; (b) and (i) without their decision-only requests")
    parser.add_argument("--remembered", type=Path, default=None,
                        help="the folder kvcomm-remembered engines start from and write their re-rotation "
                             "measurements to (KVCommConfig.remember_measurements); every other strategy remembers "
                             "nothing: its run does not depend on what ran before it")
    parser.add_argument("--noise-floor", default="",
                        help="comma-separated phases on whose reader calls (measured requests) dense also runs in "
                             "another dtype (bfloat16; float32 for a bfloat16 model): the readers' KL and agreement "
                             "that a dtype change alone moves, beside the strategies' (KL only: not a graph row)")
    parser.add_argument("--weight-layout", choices=("measured", "as_loaded", "transposed"), default="measured",
                        help="the shared model's linear weights on a CPU: measured by the first engine (the library's "
                             "default), or pinned for every strategy (kvcomm_agents.engines.weight_layout)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--summary", type=Path, default=None,
                        help="also write the run's summary (no per-call records) to this JSON file")
    args = parser.parse_args(argv)
    args.phases = [p for p in args.phases.split(",") if p]
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.noise_floor = [p for p in args.noise_floor.split(",") if p]
    for name in args.strategies:
        if not known(name):
            parser.error(f"unknown strategy '{name}'; known: {', '.join(NAMES)}, or an engine strategy + '-head-N' / '-short-N' / '-tail-N' / '-last-N'")
    if any(s.startswith("kvcomm-remembered") for s in args.strategies) and args.remembered is None:
        parser.error("kvcomm-remembered needs --remembered FOLDER (the measurements it starts from)")
    if "dense" not in args.strategies:
        parser.error("the dense strategy is the reference and must be included")
    args.strategies = ["dense"] + [s for s in args.strategies if s != "dense"]
    for phase in args.phases + args.noise_floor:
        if phase not in PHASES:
            parser.error(f"unknown phase '{phase}'; known: {', '.join(PHASES)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if args.model.startswith("random:") and args.model.split(":", 1)[1] not in TINY and device.type != "cuda":
        raise SystemExit(f"random:<shape> models are full size: run them on a GPU ({', '.join('random:' + shape for shape in TINY)} run anywhere)")
    profile = PROFILES[args.profile]
    info = versions(device)
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    print(profile.describe() + f"; data range: {args.split}", flush=True)
    torch.manual_seed(0)
    loaded = load(args.model, device=str(device), dtype=getattr(torch, args.dtype))
    layout = (choose_layout(loaded.model, "measured") if args.weight_layout == "measured"
              else pin_layout(loaded.model, args.weight_layout))
    info["weight_layout"] = f"{layout.layout} ({layout.reason})"
    args.layout = layout.layout  # in every phase's signature: phases of another layout are not reloaded
    print(f"linear weights: {info['weight_layout']}", flush=True)
    out = args.out / loaded.tag / profile.name / (args.split + ("-cold" if args.cold else ""))
    out.mkdir(parents=True, exist_ok=True)
    from kvcomm_agents.support import inspect_model

    eos = set(inspect_model(loaded.model, loaded.tokenizer, reuse=False).eos_ids)
    ctx = Context(args, profile, loaded, out, eos, device.type, ModelMeter(loaded.model))
    print(f"model {args.model} ({loaded.tag}), {args.dtype}, strategies: {', '.join(args.strategies)}; output {out}",
          flush=True)
    results = {"versions": info, "profile": asdict(profile), "model": args.model, "dtype": args.dtype,
               "split": args.split, "cold": args.cold,
               "remembered": None if args.remembered is None else str(args.remembered), "phases": {}}
    all_records, rows = [], []
    for phase in args.phases:
        saved = run_phase(ctx, phase)
        rows += report.summarize(saved["records"])
        all_records += saved["records"]
        results["phases"][phase] = {
            "title": saved["title"], "requests": saved["requests"], "elapsed_s": saved["elapsed_s"],
            "graphs": summarize_graphs(saved["records"]), "decisions": summarize_decisions(saved["answers"])
            if phase != "b-e2e" else [], "answers": report.summarize_answers(saved["answers"])
            if phase == "b-e2e" else [], "warmup_cost": report.warmup_cost(saved["records"]),
            "first_request": report.first_request(saved["records"]), "concurrent": saved.get("concurrent", False),
            "by_format": summarize_by_format(saved["records"]), "noise_floor": noise_floor_readers(
                saved["records"], every_reader=phase in args.noise_floor)}
        if phase == "b-e2e" and not saved.get("concurrent"):
            results["phases"][phase]["pipeline_wall"] = measure.pipeline_wall_times(saved["records"])
        results["phases"][phase]["verdict"] = fastest_and_closest(results["phases"][phase]["graphs"]).get(phase)
        results["rows"] = rows
        (out / "results.json").write_text(json.dumps(results, indent=1))
    for phase in args.phases:
        print(phase_console(phase, results["phases"][phase]))
    print("\n" + GRAPH_LEGEND)
    if not args.no_plots:
        try:
            results["plots"] = [str(p) for p in make_plots(rows, all_records, results, out / "plots")]
            print("plots: " + ", ".join(results["plots"]))
        except ImportError as error:  # GPU machines may lack matplotlib: the JSON holds every figure
            print(f"plots skipped ({error}); pip install 'kvcomm-agents[bench]'")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"written {out / 'results.json'}")
    if args.summary is not None:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary(results), indent=1) + "\n")
        print(f"written {args.summary}")
    return results


def summary(results: dict) -> dict:
    """What the docs quote from a run: versions, profile, per phase the whole-graph rows, the
    decisions and the verdict (no per-call records)."""
    keep = ("title", "requests", "elapsed_s", "graphs", "decisions", "answers", "warmup_cost", "first_request",
            "verdict", "pipeline_wall", "noise_floor")
    return {k: results[k] for k in ("versions", "profile", "model", "dtype", "split", "cold", "remembered")
                                 if k in results} | {
        "phases": {p: {k: v for k, v in phase.items() if k in keep} for p, phase in results["phases"].items()}}


def make_plots(rows: list[dict], records: list[dict], results: dict, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for phase in GRAPH_PHASES:
        if phase in results["phases"]:
            made.append(report.plot_ttft_by_agent(rows, phase, results["phases"][phase]["title"],
                                                  folder / f"ttft_by_agent_{phase}.png"))
    graph_rows = [r for p in results["phases"].values() for r in p.get("graphs", [])]
    if graph_rows:
        made.append(report.plot_graph_speedups(graph_rows, folder / "graph_speedup_by_workload.png"))
    return made
