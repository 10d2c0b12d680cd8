"""`mxlaunch launch -- CMD`: plan, then run the engine with the fastest correct weight path (registered by cli/app.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer
from rich.markup import escape

from mxlaunch import settings
from mxlaunch.cli.common import artifact_path_option, err, json_option, out, plain_fields, print_json
from mxlaunch.contract import LAUNCH_STRATEGIES as STRATEGIES
from mxlaunch.engines.registry import ENGINES
from mxlaunch.safety.redact import redact, redact_argv, redact_env, redact_text, secret_values

if TYPE_CHECKING:
    from mxlaunch.launch.decide import LaunchPlan

CONTEXT = {"allow_interspersed_args": False, "ignore_unknown_options": True}  # CMD's own flags pass through
_SNAPSHOT_FORMAT_HELP = "raw (mxlaunch's: tensors before post-processing; every engine)" + "".join(
    f" | {' | '.join(e.snapshot_formats)} ({e.display}'s stock formats; riskier, see docs/)"
    for e in ENGINES.values() if e.snapshot_formats) + "."


def _kept_bytes(plan: "LaunchPlan") -> int:
    """--keep-staged in a dry run: the bytes of this plan's stage that the last launch kept (staging/kept.py)."""
    from mxlaunch.launch.cleanup import user_roots
    from mxlaunch.staging import kept

    expected = plan.stage_expected()
    return max((kept.available(root, plan.source_id, expected) for root in user_roots()), default=0)


def launch(
    command: List[str] = typer.Argument(None, help="The engine's own command, after --.", show_default=False),
    artifact_path: Optional[Path] = artifact_path_option(),
    strategy: str = typer.Option("auto", "--strategy", help=" | ".join(STRATEGIES) + "."),
    capture_only: bool = typer.Option(False, "--capture-only", help="Serve until the snapshot is published, then stop (exit 0)."),
    ready_timeout: float = typer.Option(1800.0, "--ready-timeout", help="Seconds to wait for the engine to be ready."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Where the engine log goes [default: ~/.cache/mxlaunch/runs/<run>]."),
    readers: Optional[int] = typer.Option(None, "--readers", min=1, help="Parallel staging readers [default: 32; in a Slurm job 2 per CPU of the node, 4–32; a store on Lustre: 16 per OST its files sit on, up to 128]."),
    snapshot_format: str = typer.Option("raw", "--snapshot-format", help=_SNAPSHOT_FORMAT_HELP),
    no_kernel_cache: bool = typer.Option(False, "--no-kernel-cache", help="Leave the engine's JIT kernel caches alone (no restore, no capture)."),
    no_p2p: bool = typer.Option(False, "--no-p2p", help="Neither pull the weights from a live replica over NIXL nor serve them to others."),
    registry: Optional[str] = typer.Option(None, "--registry", help="P2P source registry: file (the store's folder, default) or redis://HOST:PORT/DB [env MXLAUNCH_REGISTRY]."),
    capture_id: Optional[str] = typer.Option(None, "--capture-id", help="One capture over several nodes: the same id on "
                                             "every node (in a Slurm job step: the job and step ids, set for you)."),
    no_engine_fork: bool = typer.Option(False, "--no-engine-fork", help="Leave the engine's start method as it is (vLLM on "
                                        "CUDA: the engine core is forked from the API server, not spawned to import vLLM again)."),
    zygote: bool = typer.Option(False, "--zygote", help="Fork restarts from a warm interpreter that has imported the engine "
                                "(started after this run is ready; it waits on the node until idle for 15 min). Where CRIU 4+ "
                                "runs (MXLAUNCH_CRIU or criu on PATH, CAP_CHECKPOINT_RESTORE), it is also dumped into the "
                                "store and a node's first start restores it instead of importing."),
    no_zygote_image: bool = typer.Option(False, "--no-zygote-image", help="With --zygote: never dump or restore the "
                                         "zygote with CRIU."),
    engine_snapshot: bool = typer.Option(False, "--engine-snapshot", help="Restore this command's engine snapshot (CUDA "
                                         "checkpoint + CRIU 4.2+) instead of starting the engine; without one, take it "
                                         "once the engine serves (the engine pauses for it). Node-local, in "
                                         "MXLAUNCH_ENGINE_SNAPSHOTS; it holds the engine's GPU memory: size the KV cache."),
    keep_staged: bool = typer.Option(False, "--keep-staged", help="Keep the staged snapshot in /dev/shm after loading "
                                     "(hard links: no copy) so that the next launch of the same snapshot on this node "
                                     "reads nothing from the store; it holds that RAM until `mxlaunch kept --drop`, or "
                                     "until a stage needs the room [env MXLAUNCH_KEEP_STAGED=1].",
                                     envvar=settings.KEEP_STAGED),
    no_download: bool = typer.Option(False, "--no-download", help="Leave a hub id that is not in the hub cache, or an "
                                     "s3:// model, to the engine (by default mxlaunch downloads it once per artifact store first)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and run nothing."),
    as_json: bool = json_option("JSON plan (dry run) or JSON-lines events."),
) -> None:
    """Run an engine command with the fastest correct weight path: P2P from a live replica, staged snapshot, capture, or default."""
    from mxlaunch.launch.decide import LaunchOptions, make_plan
    from mxlaunch.launch.run import Launcher

    opts = LaunchOptions(artifact_path=artifact_path, strategy=strategy, capture_only=capture_only,
                         ready_timeout=ready_timeout, run_dir=run_dir, readers=readers, as_json=as_json,
                         snapshot_format=snapshot_format, kernel_cache=not no_kernel_cache,
                         p2p=not no_p2p and not engine_snapshot,  # a NIXL agent is no state to freeze and bring back
                         registry=registry, capture_id=capture_id, zygote=zygote,
                         # a forked engine core keeps the API server's CUDA device files, which no checkpoint releases
                         engine_fork=not no_engine_fork and not engine_snapshot,
                         zygote_image=not no_zygote_image, engine_snapshot=engine_snapshot, keep_staged=keep_staged)

    known: frozenset[str] = secret_values(command or (), os.environ, [registry])  # what no output may show

    def emit(event: str, **fields: object) -> None:
        fields = redact(fields, known)  # every event, either form: URLs, secret flags, the launch's secret values
        if as_json:
            print_json({"event": event, **fields})
        elif event == "ready":
            phases = fields.get("phases") or {}
            shown = " · ".join(f"{name} {sec:.2f}s" for name, sec in phases.items() if sec)  # type: ignore[union-attr]
            err.print(f"[bold green]mxlaunch ready[/] in {fields['seconds']:.1f} s (strategy {fields['strategy']}, "
                      f"kernel cache {fields.get('kernel_cache', 'off')}): "
                      f"{escape(shown)}", highlight=False)
        else:
            detail = plain_fields(fields, skip=("argv", "log_tail"))
            err.print(f"[bold cyan]mxlaunch[/] {event}: {escape(detail)}", highlight=False)
            if fields.get("log_tail"):
                err.print(escape(str(fields["log_tail"])), highlight=False)

    command = list(command or [])
    if not dry_run and not no_download and strategy != "default":  # a new hub id or an S3 model: once per store, then planned
        from mxlaunch.launch.model_fetch import localize_command
        from mxlaunch.store.opener import open_store

        command = localize_command(command, open_store(artifact_path), emit)
    plan = make_plan(command, opts)
    known = secret_values(plan.argv, os.environ, [registry, plan.p2p.registry if plan.p2p else None]) | known
    if plan.slurm and plan.slurm["message"] and not as_json:  # what Slurm changed, in one line (JSON: the plan's "slurm")
        err.print(f"[bold cyan]mxlaunch[/] slurm: {escape(redact_text(plan.slurm['message'], known))}", highlight=False)
    if dry_run:
        kept_bytes = _kept_bytes(plan) if keep_staged else None
        if as_json:
            print_json(redact({**plan.to_json(), **({"kept_bytes": kept_bytes} if kept_bytes is not None else {})}, known))
        else:
            show = lambda text: escape(redact_text(str(text), known))  # noqa: E731 — the dry run's every free text
            out.print(f"strategy [bold]{plan.strategy}[/]: {show(plan.reason)}")
            out.print(f"source id {plan.source_id} · engine {plan.spec.engine} {plan.spec.engine_version or '(not installed)'}"
                      f" · tp {plan.spec.tp} pp {plan.spec.pp} dp {plan.spec.dp}")
            if plan.runtime is not None:
                out.print(f"engine version from {show(plan.runtime.version_from)}", highlight=False)
            out.print("command: " + escape(" ".join(redact_argv(plan.argv, known))))
            kc = plan.kernel_cache or {}
            out.print(f"kernel cache [bold]{kc.get('status', 'off')}[/]{' ' + kc['key'] if kc.get('key') else ''}: "
                      f"{show(kc.get('reason', ''))}", highlight=False)
            if plan.p2p is not None:
                p = plan.p2p
                out.print(f"p2p {p.layout} layout via {show(p.registry)}: "
                          f"{'pull from ' + show(p.describe()) if p.can_pull else show(p.why_not)}"
                          f"{'; workers serve after loading' if p.serve else ''}", highlight=False)
            start = plan.engine_start
            if start is not None:
                env = " ".join(f"{k}={v}" for k, v in redact_env(start.env, known).items())
                out.print(f"engine start: {escape(env + ' — ' if env else '')}{show(start.fork_reason)}; "
                          f"zygote {'on' if start.zygote else 'off'}: {show(start.zygote_reason)}", highlight=False)
            if plan.engine_snapshot is not None:  # --engine-snapshot: restore | take | off (warmstart/snapshot_plan.py)
                snap = plan.engine_snapshot
                out.print(f"engine snapshot [bold]{snap['status']}[/]{' ' + snap['key'] if snap.get('key') else ''}: "
                          f"{show(snap['reason'])}", highlight=False)
            if plan.quantization is not None:  # engines/quantization.py: raw | processed | default
                q = plan.quantization
                out.print(f"quantization {show(q['method'])} ({show(q['named_by'])}) restored [bold]{q['restore']}[/]: "
                          f"{show(q['reason'])}", highlight=False)
            if plan.capture_via:
                out.print(f"capture via [bold]{plan.capture_via}[/]: {show(plan.capture_via_reason)}", highlight=False)
            if plan.stage_files:
                out.print(f"would stage {len(plan.stage_files)} files, {plan.stage_bytes / (1 << 30):.2f} GiB")
            if kept_bytes is not None and plan.stage_files:
                out.print(f"kept in /dev/shm by the last launch: {kept_bytes / (1 << 30):.2f} GiB of it would be linked, "
                          "not read (--keep-staged)")
        return
    plan.refuse_unstartable()
    if capture_only and plan.strategy != "capture":
        from mxlaunch.errors import UsageError

        raise UsageError(f"--capture-only: nothing to capture ({plan.reason})", "drop --capture-only to serve")

    def echo(line: str) -> None:
        (sys.stderr if as_json else sys.stdout).write(line + "\n")

    if plan.slurm and as_json:
        emit("slurm", **plan.slurm)
    code = Launcher(plan, opts, emit=emit, echo=echo, watchdog=True).run()
    raise typer.Exit(code)
