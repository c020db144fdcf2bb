"""specserve bench: measure any OpenAI-compatible server, or A/B two of them.

Speed is ``usage.completion_tokens`` over the client's wall clock of a non-streaming,
temperature-0 request; the median over prompts x runs is reported with its min and max.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specserve.bench import analysis, report
from specserve.bench.client import BenchClient
from specserve.bench.documents import load_document
from specserve.bench.runner import (Plan, RunLog, Target, TokenCache, make_target, run_ab,
                                    run_session)
from specserve.bench.scenarios import TtftOptions
from specserve.bench.suites import load_suites
from specserve.errors import SpecserveError

SCENARIOS = ("suites", "prefix", "needle", "concurrency")


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_parser(subparsers: Any) -> None:
    """Register ``specserve bench``."""
    p = subparsers.add_parser("bench", help="measure speed, losslessness and acceptance of a server",
                              description=__doc__.splitlines()[0])
    t = p.add_argument_group("servers")
    t.add_argument("--url", help="OpenAI-compatible server to measure (the candidate, A)")
    t.add_argument("--baseline", help="second server (B); runs are interleaved A, B, A, B per prompt")
    t.add_argument("--ab", nargs=2, metavar=("SERVE_ARGS_A", "SERVE_ARGS_B"),
                   help="start 'specserve serve <args>' for A, then B, and compare them; quote each "
                        "(a lone flag needs a leading space: ' --foo')")
    t.add_argument("--serve", metavar="SERVE_ARGS", default=None,
                   help="start one 'specserve serve <args>' and measure it (like --ab with one configuration)")
    t.add_argument("--ab-rounds", type=int, default=1, help="repeat A, B this many times (--ab)")
    t.add_argument("--labels", default=None, help="names of A,B (default candidate,baseline)")
    t.add_argument("--startup-timeout", type=int, default=600, help="seconds to wait for /health (--ab)")
    t.add_argument("--model", default=None, help="model name (default: first id of /v1/models)")
    t.add_argument("--api-key", default=None)
    t.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    t.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    s = p.add_argument_group("suites")
    s.add_argument("--suite", default="code,math,prose",
                   help="comma list: code, math, prose, edit, humaneval, gsm8k, mtbench, or a .jsonl path")
    s.add_argument("--limit", type=int, default=None, help="prompts per suite")
    s.add_argument("--runs", type=int, default=3)
    s.add_argument("--max-tokens", type=int, default=512)
    s.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests per server")
    c = p.add_argument_group("scenarios")
    c.add_argument("--scenario", default="suites", help=f"comma list of {', '.join(SCENARIOS)}")
    c.add_argument("--prefix-tokens", type=int, default=4096, help="shared prefix length (2K-8K)")
    c.add_argument("--rounds", type=int, default=4, help="questions over the shared prefix")
    c.add_argument("--ttft", choices=["stream", "max1"], default="stream",
                   help="TTFT from a stream's first chunk, or a max_tokens=1 request")
    c.add_argument("--lengths", type=_ints, default=None, help="needle document lengths in tokens")
    c.add_argument("--context-max", type=int, default=None, help="context length for default lengths")
    c.add_argument("--depth", type=float, default=0.5, help="needle position, 0 (start) to 1 (end)")
    c.add_argument("--document", default=None, help="text file to use as the long document")
    c.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16])
    c.add_argument("--requests-per-client", type=int, default=2)
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="JSON file with every raw measurement")
    o.add_argument("--markdown", default=None, help="Markdown report file")
    o.add_argument("--chart", default=None, help="PNG chart of tok/s per suite and configuration")
    o.add_argument("--quiet", action="store_true", help="no progress bar or tables")
    p.set_defaults(func=run)


def validate(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Check flag combinations; returns (labels, scenarios)."""
    if sum(map(bool, (args.url, args.ab, args.serve))) != 1:
        raise SpecserveError("give exactly one of --url (with optional --baseline), --serve ARGS or --ab A B")
    if (args.ab or args.serve) and args.baseline:
        raise SpecserveError("--baseline is for --url; --ab and --serve start their servers themselves")
    for name in ("runs", "max_tokens", "ab_rounds", "rounds", "requests_per_client", "limit", "prefix_tokens",
                 "startup_timeout", "context_max"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SpecserveError(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        raise SpecserveError("--warmup must be >= 0")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise SpecserveError("--timeout must be a positive number of seconds")
    check_output_paths(args)
    if not 0.0 <= args.depth <= 1.0:
        raise SpecserveError("--depth must be between 0 and 1")
    n = 2 if (args.ab or args.baseline) else 1
    labels = args.labels.split(",") if args.labels else ["candidate", "baseline"][:n]
    if len(labels) != n or len(set(labels)) != n or not all(labels):
        raise SpecserveError(f"--labels needs {n} distinct name(s)")
    scen = [x.strip() for x in args.scenario.split(",") if x.strip()]
    bad = [x for x in scen if x not in SCENARIOS]
    if bad or not scen:
        raise SpecserveError(f"unknown --scenario {','.join(bad)}; choose from {', '.join(SCENARIOS)}")
    return labels, scen


CHART_FORMATS = (".png", ".svg", ".pdf")


def check_output_paths(args: argparse.Namespace) -> None:
    """--out, --markdown, --chart: writable files, checked before anything is measured."""
    for flag, path in (("--out", args.out), ("--markdown", args.markdown), ("--chart", args.chart)):
        if path is None:
            continue
        p = Path(path).expanduser()
        if p.is_dir() or not path.strip():
            raise SpecserveError(f"{flag} {path!r} is a directory, not a file")
        existed = p.exists()
        try:
            open(p, "a").close()  # what the run will write at its end: fail now, not after it
        except OSError as exc:
            raise SpecserveError(f"{flag} {path}: cannot write it: {exc.strerror or exc}") from exc
        if not existed:
            p.unlink(missing_ok=True)
        if flag == "--chart" and p.suffix.lower() not in CHART_FORMATS:
            raise SpecserveError(f"--chart {path}: the file name must end in {', '.join(CHART_FORMATS)}")


def make_plan(args: argparse.Namespace, scen: list[str]) -> tuple[Plan, list[str]]:
    """Load suites and documents into a Plan; returns it with notes for the report."""
    notes: list[str] = []
    plan = Plan(suites=load_suites(args.suite, args.limit), runs=args.runs,
                max_tokens=args.max_tokens, warmup=args.warmup, scenarios=scen,
                prefix_tokens=args.prefix_tokens, rounds=args.rounds, lengths=args.lengths,
                context_max=args.context_max, depth=args.depth, concurrency=args.concurrency,
                requests_per_client=args.requests_per_client, ttft=TtftOptions(args.ttft))
    if "prefix" in scen or "needle" in scen:
        plan.document, plan.document_source = load_document(args.document)
        if plan.document_source.startswith("FALLBACK"):
            notes.append(plan.document_source)
    if "prefix" in scen and not 2048 <= args.prefix_tokens <= 8192:
        notes.append(f"--prefix-tokens {args.prefix_tokens} is outside the usual 2K-8K range")
    return plan, notes


def client_factory(args: argparse.Namespace) -> Callable[[str], BenchClient]:
    """Build clients with the shared connection flags."""
    return lambda url: BenchClient(url, api_key=args.api_key, timeout=args.timeout,
                                   endpoint=args.endpoint, model=args.model)


def measure_urls(args: argparse.Namespace, labels: list[str], plan: Plan, hook: Any,
                 factory: Callable[[str], BenchClient]) -> tuple[RunLog, list[dict[str, Any]], Any]:
    """--url [--baseline]: interleaved runs against servers that are already up."""
    urls = [args.url] + ([args.baseline] if args.baseline else [])
    targets: list[Target] = []
    log = RunLog()
    try:
        for label, url in zip(labels, urls):
            targets.append(make_target(label, url, factory))
        if len(targets) == 2:
            log.notes.append("runs were interleaved per prompt: A, B, A, B ...")
            if targets[0].client.root == targets[1].client.root:
                log.notes.append("A and B are the same server: its /metrics deltas mix both")
        run_session(targets, plan, log, hook)
        tokens = TokenCache(targets[0].client)
        tokens.prefetch(log.requests)
    finally:
        for t in targets:
            t.client.close()
    return log, [t.info for t in targets], tokens


def build_result(args: argparse.Namespace, plan: Plan, log: RunLog, infos: list[dict[str, Any]],
                 tokens: TokenCache, notes: list[str]) -> dict[str, Any]:
    """The results dict: method, configs, summary, scenarios and every raw measurement."""
    labels = [i["label"] for i in infos]
    suites = list(plan.suites) if "suites" in plan.scenarios else []
    summary = analysis.summarize(log.requests, suites, labels, log.windows, tokens, tokens.name)
    return {
        "schema": "specserve-bench/1",
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": ["specserve", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else None,
        "method": {"endpoint": args.endpoint, "temperature": 0, "stream": False,
                   "max_tokens": plan.max_tokens, "runs": plan.runs, "warmup": plan.warmup,
                   "timing": "client wall clock per request; tok/s = usage.completion_tokens / wall",
                   "statistic": "median over prompts x runs, with min and max",
                   "order": "sequential per configuration (--ab)" if args.ab else
                            "interleaved A, B per prompt and run" if len(labels) == 2 else "sequential",
                   "ab_rounds": args.ab_rounds if args.ab else None},
        "configs": infos, "suites": {k: [p.id for p in v] for k, v in plan.suites.items()},
        "notes": notes + log.notes, "summary": summary, "scenarios": log.scenarios,
        "requests": [r.to_dict() for r in log.requests],
        "warmups": [r.to_dict() for r in log.warmups], "metrics_windows": log.windows,
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of ``specserve bench``."""
    labels, scen = validate(args)
    plan, notes = make_plan(args, scen)
    console = Console(stderr=True, quiet=args.quiet)
    factory = client_factory(args)
    n = len(labels)
    total = plan.request_count(n) * (args.ab_rounds if args.ab else 1)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=args.quiet) as progress:
        task = progress.add_task("starting", total=total or None)

        def hook(description: str, advance: int = 1) -> None:
            progress.update(task, description=description, advance=advance)

        if args.ab or args.serve:
            configs = list(zip(labels, args.ab or [args.serve]))
            log, infos, tokens = run_ab(configs, args.ab_rounds, plan, factory, hook,
                                        startup_timeout=args.startup_timeout)
        else:
            log, infos, tokens = measure_urls(args, labels, plan, hook, factory)
    result = build_result(args, plan, log, infos, tokens, notes)
    write_outputs(args, result, console)
    if log.requests and not any(r.ok for r in log.requests):
        first = next((r.error for r in log.requests if getattr(r, "error", None)), None)
        print(f"error: every request failed{f' (first: {first})' if first else ''}", file=sys.stderr)
        return 1
    return 0


def write_outputs(args: argparse.Namespace, result: dict[str, Any], console: Console) -> None:
    """Terminal tables and the requested files."""
    if not args.quiet:
        report.print_rich(result, Console(quiet=args.quiet))
    if args.out:
        report.write_json(result, args.out)
        console.print(f"results: {args.out}")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(report.to_markdown(result))
        console.print(f"markdown: {args.markdown}")
    if args.chart:
        from specserve.bench.chart import write_chart

        write_chart(result, args.chart)
        console.print(f"chart: {args.chart}")
