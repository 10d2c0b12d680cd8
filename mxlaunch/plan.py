"""The plan file: how the launcher tells the in-engine plugin what to do.

The launcher writes it (atomically) into the run folder and passes its path in `MXLAUNCH_PLAN`; every
engine process (API server, engine core, each worker) reads it. Launcher and plugin talk only through
this file and marker files in the run folder — no sockets, no shared state.

    {
      "schema": 1,
      "strategy": "capture" | "staged" | "default",
      "source_id": "0123456789abcdef",
      "run_dir": "/dev/shm/mxlaunch-<uid>/<run>",      # markers live in <run_dir>/markers/
      "capture_dir": "<store>/<id>/.tmp-<capture>/.../ranks",  # capture: worker R writes <capture_dir>/<S>/*.safetensors
                                                       # (or "<run_dir>/capture": through /dev/shm, uploaded
                                                       # into the store by the launcher)
      "capture_ranks": {"0": 0, "1": 1},               # capture: worker rank R → the snapshot rank S it writes;
                                                       # workers not listed (other DP replicas) serve without
                                                       # capturing; empty: every worker writes its own rank
      "ranks": {"0": [{"path": "/dev/shm/.../0/part-00000.safetensors", "bytes": 123}], ...},
                                                       # staged: the files rank R loads, in order;
                                                       # each appears by rename when complete
      "wait_timeout_s": 600,                           # staged: give up waiting for a file after this
      "fallback_ok": true,                             # failure before any tensor lands → default loader
      "snapshot_format": "mxlaunch-raw",               # or "sglang-sharded_state": SGLang's own dump/loader
      "p2p": {"registry": "file:<store>", "layout": "raw" | "processed", "world": 2, "run_id": "<run>",
              "serve": true, "timeout_s": 300}          # p2p: where to find sources (strategy p2p pulls from one)
                                                       # and whether each worker publishes itself after loading
    }

Markers (written by the plugin, read by the launcher): `markers/loaded-<R>.json` once rank R's weights
are in place ({"rank", "bytes", "seconds", "strategy"}), `markers/captured-<R>.json` once rank R's raw
tensors are written, `markers/fallback-<R>.json` with {"reason"} when a rank fell back to the default
loader. All are written by temp name + rename.

Trust: the plan says which files become the engine's weights and where captured weights and P2P records go, so
the plugin reads it only when the file and its run folder are this user's own and nobody else could have
written or swapped them (ownership.untrusted_path: no link, this uid, no write for others, nor for anyone on a
folder above). Anything else is a PlanError — the engine's default loader serves, with the reason in its log.
Markers go into a markers folder of this user's (own_dir), each created new (O_EXCL | O_NOFOLLOW) and renamed
into place: a link planted there is replaced, never written through.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from mxlaunch import settings
from mxlaunch.contract import P2P_LAYOUTS, RAW, STRATEGIES, marker_name
from mxlaunch.errors import UsageError
from mxlaunch.safety.ownership import open_own, own_dir, untrusted_path
from mxlaunch.safety.redact import redact_url
from mxlaunch.fileutil import write_json_atomic

MAX_PLAN_BYTES = 64 << 20
REFUSED_FIX = ("the plugin reads plan files only from folders nobody else can write: start the engine through "
               "`mxlaunch launch` as this user, and have the other folder removed")

PLAN_ENV = settings.PLAN


class PlanError(ValueError):
    """The plan file is missing or malformed (the plugin then falls back to the default loader)."""


@dataclass
class RankFile:
    path: str
    bytes: int


@dataclass
class Plan:
    strategy: str
    source_id: str
    run_dir: str
    capture_dir: str | None = None
    ranks: dict[str, list[RankFile]] = field(default_factory=dict)
    wait_timeout_s: float = 600.0
    fallback_ok: bool = True
    snapshot_format: str = RAW
    p2p: dict | None = None
    capture_ranks: dict[str, int] = field(default_factory=dict)
    schema: int = 1

    @property
    def markers_dir(self) -> Path:
        return Path(self.run_dir) / "markers"

    def files_for_rank(self, rank: int) -> list[RankFile]:
        return self.ranks.get(str(rank), [])

    def capture_target(self, rank: int) -> int | None:
        """The snapshot rank worker `rank` captures, None when another worker captures its copy."""
        if not self.capture_ranks:
            return rank
        return self.capture_ranks.get(str(rank))

    def to_json(self) -> str:
        """The file's text. Its P2P registry URL is redacted (the file is output like any other); the engine gets
        the real URL in MXLAUNCH_REGISTRY (launch/run.py) and `registry_url` puts it back when the plan is read."""
        data = asdict(self)
        if data.get("p2p"):
            data["p2p"] = {**data["p2p"], "registry": redact_url(str(data["p2p"]["registry"]))}
        return json.dumps(data, indent=2, sort_keys=True)

    def to_dict(self) -> dict:
        """The file's JSON object (keys sorted, as to_json writes them)."""
        return json.loads(self.to_json())


def load_plan(path: str | os.PathLike[str] | None = None) -> Plan | None:
    """Read the plan named by MXLAUNCH_PLAN (or `path`); None when no plan is set."""
    path = path or settings.plan_path()
    if not path:
        return None
    data = _read_own_plan(path)
    if not isinstance(data, dict) or data.get("schema") != 1:
        raise PlanError(f"plan {path} has no schema 1")
    strategy = data.get("strategy")
    if strategy not in STRATEGIES:
        raise PlanError(f"plan {path}: unknown strategy {strategy!r}")
    if strategy == "p2p" and not isinstance(data.get("p2p"), dict):
        raise PlanError(f"plan {path}: strategy p2p without a p2p block")
    try:
        ranks = {
            str(rank): [RankFile(path=str(f["path"]), bytes=int(f["bytes"])) for f in files]
            for rank, files in (data.get("ranks") or {}).items()
        }
        plan = Plan(
            strategy=strategy,
            source_id=str(data["source_id"]),
            run_dir=str(data["run_dir"]),
            capture_dir=data.get("capture_dir"),
            ranks=ranks,
            wait_timeout_s=float(data.get("wait_timeout_s", 600.0)),
            fallback_ok=bool(data.get("fallback_ok", True)),
            snapshot_format=str(data.get("snapshot_format", RAW)),
            p2p=_p2p(data.get("p2p"), path),
            capture_ranks={str(k): int(v) for k, v in (data.get("capture_ranks") or {}).items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"plan {path} is malformed: {exc}") from exc
    why = untrusted_path(plan.run_dir, is_dir=True)  # where the markers go, and where a capture may land
    if why:
        raise PlanError(f"plan {path} refused: its run folder {why} — {REFUSED_FIX}")
    return plan


def _read_own_plan(path: str | os.PathLike[str]) -> object:
    """The plan file's JSON, read only when it and every folder above it are this user's alone."""
    why = untrusted_path(path, is_dir=False)
    if why:
        raise PlanError(f"plan {path} refused: {why} — {REFUSED_FIX}")
    try:
        fd = open_own(path)
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MAX_PLAN_BYTES + 1)
        if len(raw) > MAX_PLAN_BYTES:
            raise ValueError(f"larger than {MAX_PLAN_BYTES} bytes")
        return json.loads(raw.decode("utf-8"))
    except UsageError as exc:  # ownership.ForeignPath: swapped between the check and the open
        raise PlanError(f"plan {path} refused: {exc.message} — {REFUSED_FIX}") from exc
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read plan {path}: {exc}") from exc


def _p2p(data: object, path: object) -> dict | None:
    """The plan's p2p block, validated (registry URL, layout, world, run id)."""
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("registry"), str) or data.get("layout") not in P2P_LAYOUTS:
        raise PlanError(f"plan {path}: malformed p2p block {data!r}")
    if not isinstance(data.get("world"), int) or not isinstance(data.get("run_id"), str):
        raise PlanError(f"plan {path}: the p2p block needs an integer world and a run_id (got {data!r})")
    return {"registry": registry_url(data["registry"]), "layout": data["layout"], "world": data["world"],
            "run_id": data["run_id"], "serve": bool(data.get("serve", True)),
            "timeout_s": float(data.get("timeout_s", 300.0))}


def registry_url(shown: str, environ: Mapping[str, str] = os.environ) -> str:
    """The registry URL a plan file names, with the secret the file leaves out put back from MXLAUNCH_REGISTRY (the
    engine's environment, which only its own user can read) when that URL redacts to the same text."""
    real = settings.registry(environ)
    return real if real and real != shown and redact_url(real) == shown else shown


def write_marker(plan: Plan, kind: str, rank: int, payload: dict) -> Path:
    """markers/<kind>-<rank>.json, atomically, private, in a markers folder of this user's alone (own_dir:
    made 0700 or checked; ForeignPath for a link or another user's folder)."""
    os.makedirs(plan.run_dir, mode=0o700, exist_ok=True)  # the launcher made it (load_plan checked it); a bare Plan may not
    path = own_dir(plan.markers_dir) / marker_name(kind, rank)
    write_json_atomic(path, {"rank": rank, **payload}, private=True)
    return path
