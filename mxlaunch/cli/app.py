"""Command-line interface: options in, rich tables / progress / JSON out, errors to exit codes.

No logic lives here; each command calls into its module and renders the result.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from mxlaunch import __version__
from mxlaunch.cli.common import err, json_option, out, print_json
from mxlaunch.cli.launch import CONTEXT as launch_context
from mxlaunch.cli.launch import launch
from mxlaunch.cli.cache import cache_app
from mxlaunch.cli.peers import peers as peers_command
from mxlaunch.cli.zygotes import zygotes as zygotes_command
from mxlaunch.cli.kept import kept as kept_command
from mxlaunch.cli.pull import pull as pull_command
from mxlaunch.cli.store import store_app
from mxlaunch.errors import EXIT_USAGE, MxlaunchError

app = typer.Typer(
    rich_markup_mode=None,  # help texts are plain: "[default: ...]" is text, not a markup tag
    name="mxlaunch",
    help="Fast, verified cold starts for SGLang and vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


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
    from mxlaunch.verify import run as _verify
    from mxlaunch.errors import UsageError
    from mxlaunch.verify.prompts import load_prompts

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
        note = _verify.fit_note(gold)
        if note:
            err.print(f"[yellow]note:[/] {note}", highlight=False)
        if as_json:
            print_json({"recorded": str(record_path), "prompts": len(gold["prompts"]), "server": server,
                        "cut": (gold.get("fit") or {}).get("cut", [])})
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
    from mxlaunch.bench import run as _bench
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
    explain: bool = typer.Option(False, "--explain", help="List timed lines no pattern reads (their time is in unknown)."),
) -> None:
    """Cold-start phases from SGLang/vLLM logs or live runs, with statistics over runs."""
    from mxlaunch.profile import profiler as prof
    from mxlaunch.profile.live import check_startable, run_live
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
        check_startable(command)
        for i in range(1, runs + 1):
            err.print(f"run {i}/{runs}: starting {' '.join(command)}", highlight=False)
            result, code = run_live(command, timeout, engine=engine)
            state = "ready" if result.ready else (f"exited {code} before ready" if code is not None else "not ready")
            err.print(f"run {i}/{runs}: {state} after {result.total_seconds:.1f} s; stopped", highlight=False)
            results.append(result)
    else:
        raise UsageError("nothing to profile", fix="pass --log FILE or -- CMD...")
    if chart is not None:
        from mxlaunch.profile.chart import write_chart

        write_chart(results, chart)
        err.print(f"chart written to {chart}", highlight=False)
    if as_json:
        print_json(prof.report(results, explain=explain))
    else:
        for renderable in prof.render(results):
            out.print(renderable)
        for line in prof.unmatched_lines(results) if explain else []:
            out.print(line, soft_wrap=True, highlight=False, markup=False)
        if log:
            err.print("from a log: the time before its first line (interpreter start-up and imports) is not in it; "
                      "`mxlaunch profile -- CMD` times that too (interpreter_startup)", highlight=False)
    problem = prof.not_ready_message(results)
    if problem:
        raise CheckFailed(problem, fix="the profile above shows the phases it reached")


@app.command()
def stage(
    sources: List[str] = typer.Argument(..., help="Files, directories or globs to copy.", show_default=False),
    dest: Path = typer.Option(..., "--dest", "-d", help="Destination folder (e.g. /dev/shm/...)."),
    readers: Optional[int] = typer.Option(None, "--readers", "-j", help="Parallel reader threads [default: 32; on Lustre 16 per OST the files sit on, up to 128]."),
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
    from mxlaunch.cli.progress import byte_progress
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
    if readers is None:  # on Lustre, READERS_PER_OST for every OST the files sit on
        from mxlaunch.staging.schedule import readers_for_layouts

        request.readers = readers_for_layouts(request.readers, layouts)
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


# ---- store: list / verify / rm snapshots in the artifact store (mxlaunch/cli/store.py) ----

app.add_typer(store_app, name="store")
app.add_typer(cache_app, name="cache")  # JIT kernel caches (mxlaunch/cli/cache.py)

# ---- peers: the P2P source registry (mxlaunch/cli/peers.py) ----

app.command("peers")(peers_command)
app.command("zygotes")(zygotes_command)
app.command("kept")(kept_command)
app.command("pull")(pull_command)

# ---- launch (mxlaunch/cli/launch.py) ----

app.command(context_settings=launch_context)(launch)


def main() -> None:
    """Console entry point: run the app and turn our errors into one line + exit code."""
    try:
        # Non-standalone click returns the code of a `typer.Exit` instead of raising it.
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except MxlaunchError as exc:
        from mxlaunch.safety.redact import redact_text, secret_values

        line = redact_text(exc.one_line(), secret_values(sys.argv, os.environ))  # a URL or a flag value in a message
        err.print(f"[bold red]error:[/] {escape(line)}", highlight=False)
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
