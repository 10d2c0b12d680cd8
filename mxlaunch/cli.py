"""Command-line interface: options in, rich tables / progress / JSON out, errors to exit codes.

No logic lives here; each command calls into its module and renders the result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from mxlaunch import __version__, settings
from mxlaunch.contract import LAUNCH_STRATEGIES as STRATEGIES
from mxlaunch.errors import EXIT_USAGE, MxlaunchError

app = typer.Typer(
    name="mxlaunch",
    help="Fast, verified cold starts for SGLang and vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
out = Console()
err = Console(stderr=True, soft_wrap=True)  # one-line errors must never wrap


# ---- options several commands share: one definition each ----

_ARTIFACT_PATH_HELP = f"Artifact store root [default: ${settings.ARTIFACT_PATH}, else ~/.cache/mxlaunch/store]."


def json_option(help: str = "Print the result as JSON on stdout.") -> Any:
    """--json: one JSON document (or JSON lines) on stdout, always with "schema": 1."""
    return typer.Option(False, "--json", help=help)


def artifact_path_option() -> Any:
    """--artifact-path, defaulting to $MXLAUNCH_ARTIFACT_PATH (the store falls back to the user cache)."""
    return typer.Option(None, "--artifact-path", envvar=settings.ARTIFACT_PATH, help=_ARTIFACT_PATH_HELP)


def print_json(payload: dict) -> None:
    """Every --json output carries schema 1 and goes to stdout, alone."""
    payload = {"schema": 1, **payload}
    sys.stdout.write(json.dumps(payload, indent=None, sort_keys=False) + "\n")
    sys.stdout.flush()


def _version_callback(value: bool) -> None:
    if value:
        out.print(f"mxlaunch {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Fast, verified cold starts for SGLang and vLLM."""


# ---- commands are registered below, one block each --------------------------------------------

# ---- verify: record / compare prompt and greedy logprobs (issue 5) ----


@app.command("verify")
def verify_command(
    url: str = typer.Option(..., "--url", help="Server base URL, e.g. http://127.0.0.1:8000."),
    record_path: Optional[Path] = typer.Option(None, "--record", help="Record a gold file here."),
    compare_path: Optional[Path] = typer.Option(None, "--compare", help="Compare against this gold file."),
    prompts_path: Optional[Path] = typer.Option(
        None, "--prompts", help="Prompts file for --record (.json list, .jsonl, or text: one per line)."
    ),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Greedy tokens per prompt (--record; default 32)."),
    tol: float = typer.Option(0.0, "--tol", help="Largest |Δ logprob| that passes (default 0: exact)."),
    wait: float = typer.Option(0.0, "--wait", help="Seconds to wait for /health and /v1/models (0: one attempt)."),
    timeout: float = typer.Option(120.0, "--timeout", help="Per-request timeout in seconds."),
    as_json: bool = json_option("Print the result as JSON on stdout."),
) -> None:
    """Record a gold file of prompt/greedy logprobs, or compare a server against one (exit 1 on mismatch)."""
    from mxlaunch import verify as _verify
    from mxlaunch.errors import CheckFailed, UsageError
    from mxlaunch.prompts import load_prompts

    if (record_path is None) == (compare_path is None):
        raise UsageError("pass exactly one of --record FILE or --compare FILE", "see `mxlaunch verify --help`")
    if timeout <= 0:
        raise UsageError(f"--timeout {timeout} must be > 0", "pass a number of seconds")
    if record_path is not None:
        prompts = load_prompts(prompts_path)
        with err.status(f"recording {len(prompts)} prompts from {url}") as status:
            gold = _verify.record(
                url, prompts, 32 if max_tokens is None else max_tokens, wait, timeout,
                on_prompt=lambda i, name: status.update(f"recording {i + 1}/{len(prompts)}: {name}"),
            )
        _verify.write_gold(record_path, gold)
        server = gold["server"]
        if as_json:
            print_json({"recorded": str(record_path), "prompts": len(gold["prompts"]), "server": server})
            return
        from rich.table import Table

        table = Table(title=f"recorded {record_path}")
        for col in ("prompt", "prompt tokens", "output tokens"):
            table.add_column(col, justify="left" if col == "prompt" else "right")
        table.add_column("output (start)", no_wrap=True, overflow="ellipsis", max_width=32)
        for p in gold["prompts"]:
            table.add_row(p["name"], str(len(p["prompt"])), str(len(p["output"])), repr(p["output_text"][:32]))
        out.print(table)
        out.print(
            f"server: {server['api']} {server.get('engine_version') or ''} model {server['model']} — "
            f"{len(gold['prompts'])} prompts, max_tokens {gold['request']['max_tokens']}",
            highlight=False,
        )
        return
    if prompts_path is not None or max_tokens is not None:
        raise UsageError("--prompts and --max-tokens apply to --record", "--compare replays the gold file's prompts")
    gold = _verify.read_gold(compare_path)
    n = len(gold["prompts"])
    with err.status(f"comparing {n} prompts on {url}") as status:
        report = _verify.compare(
            url, gold, tol, wait, timeout, on_prompt=lambda i, name: status.update(f"comparing {i + 1}/{n}: {name}")
        )
    if as_json:
        print_json(report)
    else:
        from rich.table import Table

        table = Table(title=f"verify against {compare_path} (tol {tol:g})")
        for col in ("prompt", "tokens", "compared", "max |Δ logprob|", "result"):
            table.add_column(col, justify="left" if col in ("prompt", "result") else "right")
        for r in report["prompts"]:
            if r["error"]:
                verdict = f"[red]error[/]: {r['error'][:60]}"
            elif r["mismatch"]:
                m = r["mismatch"]
                verdict = f"[red]token id differs[/] at {m['part']}[{m['offset']}]"
            else:
                verdict = "[green]same[/]" if r["pass"] else "[red]Δ > tol[/]"
            tokens = "-" if r["prompt_tokens"] is None else f"{r['prompt_tokens']}+{r['output_tokens']}"
            delta = "-" if r["max_delta"] is None else f"{r['max_delta']:.3g}"
            table.add_row(r["name"], tokens, str(r["compared_positions"]), delta, verdict)
        out.print(table)
        for diff in report["server"]["differences"]:
            out.print(f"[yellow]note:[/] server info differs (not decisive) — {diff}", highlight=False)
        if report["pass"]:
            md = report["max_delta"]
            out.print(f"[green]PASS[/]: {n} prompts, max |Δ logprob| = {0.0 if md is None else md:.3g} ≤ tol {tol:g}")
    if not report["pass"]:
        _verify.check(report)


# ---- bench: streaming load generator (issue 5) ----


@app.command("bench")
def bench_command(
    url: str = typer.Option(..., "--url", help="Server base URL, e.g. http://127.0.0.1:8000."),
    requests: int = typer.Option(32, "--requests", help="Requests per concurrency level."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", help="Requests in flight (default 1)."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Several concurrency levels, e.g. 1,4,16."),
    input_len: int = typer.Option(128, "--input-len", help="Prompt tokens (random dataset)."),
    output_len: int = typer.Option(64, "--output-len", help="Output tokens per request (ignore_eos)."),
    dataset: str = typer.Option("random", "--dataset", help="'random' or a prompts file (.json/.jsonl/text)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name to send (default: the first of /v1/models)."),
    timeout: float = typer.Option(60.0, "--timeout", help="Per-request read timeout in seconds."),
    max_duration: float = typer.Option(600.0, "--max-duration", help="Upper bound on the whole run, seconds."),
    seed: int = typer.Option(0, "--seed", help="Seed for the random dataset."),
    wait: float = typer.Option(0.0, "--wait", help="Seconds to wait for /health and /v1/models (0: one attempt)."),
    as_json: bool = json_option("Print the result as JSON on stdout."),
) -> None:
    """Streaming benchmark: TTFT, inter-token latency, end-to-end latency, tokens/s, per concurrency level."""
    from mxlaunch import bench as _bench
    from mxlaunch.errors import UsageError

    if concurrency is not None and sweep is not None:
        raise UsageError("--concurrency and --sweep exclude each other", "pass one of them")
    levels = _bench.parse_sweep(sweep) if sweep is not None else [1 if concurrency is None else concurrency]
    with err.status(f"benchmarking {url}") as status:
        result = _bench.run_bench(
            url, requests=requests, concurrencies=levels, input_len=input_len, output_len=output_len,
            dataset=dataset, wait_s=wait, timeout=timeout, max_duration=max_duration, seed=seed, model=model,
            on_level=lambda c: status.update(f"benchmarking {url}: concurrency {c}, {requests} requests"),
        )
    if as_json:
        print_json(result)
        return
    from rich.table import Table

    def fmt(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"

    table = Table(title=f"bench {result['model']} @ {result['url']} — in {input_len} / out {output_len} tokens")
    for col in ("conc", "ok", "err", "req/s", "out tok/s", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
                "E2E p50/p90/p99 ms"):
        table.add_column(col, justify="right")
    for lv in result["levels"]:
        trip = lambda s: " / ".join(fmt(s[k]) for k in ("p50", "p90", "p99"))  # noqa: E731
        table.add_row(
            str(lv["concurrency"]), str(lv["completed"]), str(lv["errors"]), fmt(lv["requests_per_s"]),
            fmt(lv["output_tokens_per_s"]), trip(lv["ttft_ms"]), trip(lv["itl_ms"]), trip(lv["e2e_ms"]),
        )
    out.print(table)
    for lv in result["levels"]:
        for sample in lv["error_samples"]:
            err.print(f"[yellow]error sample (concurrency {lv['concurrency']}):[/] {sample}", highlight=False)


@app.command("profile")
def profile_command(
    command: Optional[List[str]] = typer.Argument(None, help="-- CMD...: run it, profile until ready, stop it.", show_default=False),
    log: Optional[List[Path]] = typer.Option(None, "--log", help="Engine log file(s); several are several runs.", show_default=False),
    engine: str = typer.Option("auto", "--engine", help="auto, or an engine's name (mxlaunch.engines.registry)."),
    runs: int = typer.Option(1, "--runs", min=1, help="Live mode: run the command N times."),
    timeout: float = typer.Option(900.0, "--timeout", min=1.0, help="Live mode: seconds to wait for ready, per run."),
    multinode: bool = typer.Option(False, "--multinode", help="The --log files are the nodes of one run."),
    as_json: bool = json_option("Print one JSON document on stdout."),
    chart: Optional[Path] = typer.Option(None, "--chart", help="Write a stacked-bar PNG of the phases here."),
) -> None:
    """Cold-start phases from SGLang/vLLM logs or live runs, with statistics over runs."""
    from mxlaunch import profile as prof
    from mxlaunch.errors import CheckFailed, UsageError

    if engine not in prof.ENGINES:
        raise UsageError(f"unknown engine {engine!r}", fix=f"use --engine {' | '.join(prof.ENGINES)}")
    if log:
        files = list(log) + [Path(c) for c in command or []]  # `--log a.log b.log` works too
        results = [prof.profile_file(f, engine) for f in files]
        if multinode:
            results = [prof.merge_nodes(results)]
    elif command:
        results = []
        for i in range(1, runs + 1):
            err.print(f"run {i}/{runs}: starting {' '.join(command)}", highlight=False)
            result, code = prof.run_live(command, timeout, engine=engine)
            state = "ready" if result.ready else (f"exited {code} before ready" if code is not None else "not ready")
            err.print(f"run {i}/{runs}: {state} after {result.total_seconds:.1f} s; stopped", highlight=False)
            results.append(result)
    else:
        raise UsageError("nothing to profile", fix="pass --log FILE or -- CMD...")
    if chart is not None:
        from mxlaunch.chart import write_chart

        write_chart(results, chart)
        err.print(f"chart written to {chart}", highlight=False)
    if as_json:
        print_json(prof.report(results))
    else:
        for renderable in prof.render(results):
            out.print(renderable)
    problem = prof.not_ready_message(results)
    if problem:
        raise CheckFailed(problem, fix="the profile above shows the phases it reached")


@app.command()
def stage(
    sources: List[str] = typer.Argument(..., help="Files, directories or globs to copy.", show_default=False),
    dest: Path = typer.Option(..., "--dest", "-d", help="Destination folder (e.g. /dev/shm/...)."),
    readers: Optional[int] = typer.Option(None, "--readers", "-j", help="Parallel reader threads [default: 32]."),
    chunk_size: str = typer.Option("16MiB", "--chunk-size", help="Bytes per read request (multiple of 4 KiB)."),
    manifest: Optional[Path] = typer.Option(None, "--manifest", help="Check each copy against this manifest (path → bytes, xxh3_128)."),
    write_manifest_to: Optional[Path] = typer.Option(None, "--write-manifest", help="Write a manifest of the copies here."),
    verify: bool = typer.Option(False, "--verify", help="Re-read each source and compare checksums with its copy."),
    rate_limit: Optional[str] = typer.Option(None, "--rate-limit", help="Cap total read rate, e.g. 2GiB (per second)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace destination files that exist."),
    no_direct: bool = typer.Option(False, "--no-direct", help="Use buffered reads (skip O_DIRECT)."),
    per_file: Optional[int] = typer.Option(None, "--per-file", help="Most reads in flight per file [default: readers/4 in mmap mode, readers/8 otherwise]."),
    write_mode: str = typer.Option("mmap", "--write-mode", help="mmap (read into the mapped destination), pwrite (read into a buffer, then write) or procs (pwrite in reader processes)."),
    no_huge_pages: bool = typer.Option(False, "--no-huge-pages", help="Keep tmpfs destinations in 4 KiB pages (no MADV_COLLAPSE)."),
    as_json: bool = json_option("Print a JSON summary on stdout."),
) -> None:
    """Copy files into DEST with parallel O_DIRECT reads; each file appears (by rename) when complete."""
    from mxlaunch.errors import UsageError
    from mxlaunch.progress import byte_progress
    from mxlaunch.stage import StageRequest, default_readers, plan_items, run_stage
    from mxlaunch.staging.capacity import format_bytes, parse_size

    try:
        chunk = parse_size(chunk_size)
        rate = float(parse_size(rate_limit)) if rate_limit else None
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    request = StageRequest(
        sources=sources, dest=dest, readers=default_readers() if readers is None else readers, chunk_size=chunk,
        manifest=manifest, write_manifest=write_manifest_to, verify=verify, rate_limit=rate,
        overwrite=overwrite, use_o_direct=not no_direct, write_mode=write_mode,
        per_file=per_file, huge_pages=not no_huge_pages,
    )
    items, layouts = plan_items(request)
    total = sum(item.size for item in items)
    with byte_progress(err, total, "staging", enabled=not as_json) as advance:
        result = run_stage(request, items, layouts, on_progress=advance)
    if not result.o_direct and not no_direct:
        err.print("note: the source filesystem refused O_DIRECT for some files; those used buffered reads")
    if as_json:
        print_json({
            "files": [{"src": str(f.src), "dest": str(f.dest), "bytes": f.bytes} for f in result.files],
            "bytes": result.bytes,
            "seconds": round(result.seconds, 6),
            "gib_per_s": round(result.gib_per_s, 4),
            "readers": result.readers,
            "o_direct": result.o_direct,
        })
    else:
        err.print(
            f"staged {len(result.files)} files, {format_bytes(result.bytes)} in {result.seconds:.2f} s "
            f"({result.gib_per_s:.2f} GiB/s, {result.readers} readers, O_DIRECT {'on' if result.o_direct else 'off'})"
        )


@app.command()
def doctor(
    path: Path = typer.Option(Path("."), "--path", "-p", help="Folder to probe for O_DIRECT (artifact store, weights)."),
    as_json: bool = json_option("Print the checks as JSON."),
) -> None:
    """What this node can do: O_DIRECT, /dev/shm, memory limits, Lustre, GPUs, NIXL, Slurm, engines."""
    from rich.markup import escape
    from rich.table import Table

    from mxlaunch.doctor import as_dicts, run_checks

    rows = run_checks(path)
    if as_json:
        print_json({"checks": as_dicts(rows)})
        return
    style = {"ok": "green", "missing": "yellow", "warn": "red", "info": "cyan"}
    table = Table(title="mxlaunch doctor", show_lines=False)
    for column in ("check", "status", "detail", "how to fix"):
        table.add_column(column)
    for row in rows:
        table.add_row(escape(row.name), f"[{style.get(row.status, 'white')}]{row.status}[/]", escape(row.detail),
                      escape(row.fix))
    out.print(table)


# ---- store: list / verify / rm snapshots in the artifact store (issue 3) ----

store_app = typer.Typer(
    help="See, check and remove snapshots in the artifact store.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(store_app, name="store")


@store_app.command("list")
def store_list(
    artifact_path: Optional[Path] = artifact_path_option(),
    as_json: bool = json_option("Print the snapshots as JSON."),
) -> None:
    """Every snapshot in the store: model, engine, parallelism, size, created, status (ok/incomplete/claimed/refused).

    --json has every field, the model's full path and the snapshot's rank count included."""
    from rich.table import Table

    from mxlaunch.staging.capacity import format_bytes
    from mxlaunch.store import Store

    store = Store(artifact_path)
    entries = store.list()
    if as_json:
        print_json({"root": str(store.root), "snapshots": [e.to_dict() for e in entries]})
        return
    # Readable at 80 columns: no borders, one space between columns, the model by name (the path is in
    # --json), the date without the time; only the model may wrap.
    table = Table(title=f"snapshots in {escape(str(store.root))}", box=None, pad_edge=False, padding=(0, 1, 0, 0),
                  title_justify="left", header_style="bold underline")
    for col in ("id", "model", "engine", "tp/pp", "size", "created", "status"):
        table.add_column(col, justify="right" if col == "size" else "left", overflow="fold",
                         no_wrap=col in ("id", "engine", "size", "created"), min_width={"model": 12, "status": 6}.get(col))
    style = {"ok": "green", "claimed": "cyan", "incomplete": "yellow", "refused": "red"}
    for e in entries:
        d = e.to_dict()
        engine = " ".join(str(x) for x in (d["engine"], d["engine_version"]) if x) or "-"
        tp_pp = f"{d['tp'] or '-'}/{d['pp'] or '-'}" if d["tp"] or d["pp"] else "-"
        status = f"[{style.get(e.status, 'white')}]{e.status}[/]"
        if e.status == "claimed" and e.holder is not None:
            status += f" ({escape(e.holder.describe())})"
        table.add_row(e.source_id, escape(str(d["model_name"] or "-")), escape(engine), tp_pp, format_bytes(e.bytes), str(d["created_at"] or "-")[:10], status)
    out.print(table)
    for e in entries:
        if e.status == "refused":
            out.print(f"{e.source_id}: {escape(e.reason)}", highlight=False, soft_wrap=True)


@store_app.command("verify")
def store_verify(
    source_id: str = typer.Argument(..., help="Snapshot id (see `mxlaunch store list`)."),
    artifact_path: Optional[Path] = artifact_path_option(),
    quick: bool = typer.Option(False, "--quick", help="Check manifest, paths and sizes only (no checksums)."),
    as_json: bool = json_option("Print the result as JSON."),
) -> None:
    """Check a snapshot: manifest, ranks, paths inside the store, sizes and xxh3_128 checksums (exit 1 on failure)."""
    from mxlaunch.errors import CheckFailed, UsageError
    from mxlaunch.staging.capacity import format_bytes
    from mxlaunch.store import Store

    store = Store(artifact_path)
    if not store.folder(source_id).is_dir():
        raise UsageError(f"no snapshot {source_id} in {store.root}", "see `mxlaunch store list`")
    with err.status(f"verifying {source_id}"):
        report = store.verify(source_id, full=not quick)
    if as_json:
        print_json(report.to_dict())
    elif report.ok:
        out.print(f"{source_id}: ok — {report.files} files, {format_bytes(report.bytes)}"
                  f"{', checksums match' if report.full else ' (sizes only)'}", highlight=False)
    else:
        for problem in report.problems:
            out.print(f"{source_id}: {escape(problem)}", highlight=False, soft_wrap=True)
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise CheckFailed(f"snapshot {source_id} failed verification: {report.problems[0]}{more}",
                          f"remove it with `mxlaunch store rm {source_id}`; the next launch captures it again")


@store_app.command("rm")
def store_rm(
    source_id: str = typer.Argument(..., help="Snapshot id (see `mxlaunch store list`)."),
    artifact_path: Optional[Path] = artifact_path_option(),
    force: bool = typer.Option(False, "--force", help="Remove it even while a capture claims it."),
    as_json: bool = json_option("Print the result as JSON."),
) -> None:
    """Remove a snapshot (refused while a capture holds its claim, unless --force)."""
    from mxlaunch.store import Store

    store = Store(artifact_path)
    store.remove(source_id, force=force)
    if as_json:
        print_json({"removed": source_id, "root": str(store.root)})
    else:
        out.print(f"removed {source_id} from {escape(str(store.root))}", highlight=False)


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def launch(
    command: List[str] = typer.Argument(None, help="The engine's own command, after --.", show_default=False),
    artifact_path: Optional[Path] = artifact_path_option(),
    strategy: str = typer.Option("auto", "--strategy", help=" | ".join(STRATEGIES) + "."),
    capture_only: bool = typer.Option(False, "--capture-only", help="Serve until the snapshot is published, then stop (exit 0)."),
    ready_timeout: float = typer.Option(1800.0, "--ready-timeout", help="Seconds to wait for the engine to be ready."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Where the engine log goes [default: ~/.cache/mxlaunch/runs/<run>]."),
    readers: Optional[int] = typer.Option(None, "--readers", min=1, help="Parallel staging readers [default: 32; in a Slurm job 2 per CPU of the node, 4–32]."),
    snapshot_format: str = typer.Option("raw", "--snapshot-format",
                                        help="raw (mxlaunch's: tensors before post-processing; every engine) | "
                                             "sharded_state | presharded (SGLang's stock formats; riskier, see docs/sglang.md)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and run nothing."),
    as_json: bool = json_option("JSON plan (dry run) or JSON-lines events."),
) -> None:
    """Run an engine command with the fastest correct weight path: staged snapshot, capture, or default."""
    from mxlaunch.launch import LaunchOptions, Launcher, make_plan

    opts = LaunchOptions(artifact_path=artifact_path, strategy=strategy, capture_only=capture_only,
                         ready_timeout=ready_timeout, run_dir=run_dir, readers=readers, as_json=as_json,
                         snapshot_format=snapshot_format)
    plan = make_plan(list(command or []), opts)
    if plan.slurm and plan.slurm["message"] and not as_json:  # what Slurm changed, in one line (JSON: the plan's "slurm")
        err.print(f"[bold cyan]mxlaunch[/] slurm: {escape(plan.slurm['message'])}", highlight=False)
    if dry_run:
        if as_json:
            print_json(plan.to_json())
        else:
            out.print(f"strategy [bold]{plan.strategy}[/]: {escape(plan.reason)}")
            out.print(f"source id {plan.source_id} · engine {plan.spec.engine} {plan.spec.engine_version or '(not installed)'}"
                      f" · tp {plan.spec.tp} pp {plan.spec.pp} dp {plan.spec.dp}")
            out.print("command: " + escape(" ".join(plan.argv)))
            if plan.stage_files:
                out.print(f"would stage {len(plan.stage_files)} files, {plan.stage_bytes / (1 << 30):.2f} GiB")
        return
    if capture_only and plan.strategy != "capture":
        from mxlaunch.errors import UsageError

        raise UsageError(f"--capture-only: nothing to capture ({plan.reason})", "drop --capture-only to serve")

    def emit(event: str, **fields: object) -> None:
        if as_json:
            print_json({"event": event, **fields})
        elif event == "ready":
            phases = fields.get("phases") or {}
            shown = " · ".join(f"{name} {sec:.2f}s" for name, sec in phases.items() if sec)  # type: ignore[union-attr]
            err.print(f"[bold green]mxlaunch ready[/] in {fields['seconds']:.1f} s (strategy {fields['strategy']}): "
                      f"{escape(shown)}", highlight=False)
        else:
            detail = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("argv", "log_tail"))
            err.print(f"[bold cyan]mxlaunch[/] {event}: {escape(detail)}", highlight=False)
            if fields.get("log_tail"):
                err.print(escape(str(fields["log_tail"])), highlight=False)

    def echo(line: str) -> None:
        (sys.stderr if as_json else sys.stdout).write(line + "\n")

    if plan.slurm and as_json:
        emit("slurm", **plan.slurm)
    code = Launcher(plan, opts, emit=emit, echo=echo).run()
    raise typer.Exit(code)


def main() -> None:
    """Console entry point: run the app and turn our errors into one line + exit code."""
    try:
        # Non-standalone click returns the code of a `typer.Exit` instead of raising it.
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except MxlaunchError as exc:
        err.print(f"[bold red]error:[/] {escape(exc.one_line())}", highlight=False)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as exc:
        # Click's usage errors (typer vendors click, so match by shape, not by class).
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            err.print(f"[bold red]error:[/] {escape(exc.format_message())} — see `mxlaunch --help`", highlight=False)
            sys.exit(EXIT_USAGE)
        raise


if __name__ == "__main__":
    main()
