"""The launcher ↔ plugin ↔ store contract: names and formats both sides must agree on, defined once.

The launcher writes a plan file (mxlaunch/plan.py) and reads marker files; the in-engine plugin reads
the plan, writes the markers and prints one log line per loaded rank; the store records the snapshot
format and version. Everything those three share by value lives here, so that a change is one edit.
This module imports nothing heavy: the plugin imports it inside every engine worker.
"""

from __future__ import annotations

from pathlib import Path

# ---- load format and snapshot formats ------------------------------------------------------------------

LOAD_FORMAT = "mxlaunch"  # vLLM's --load-format for mxlaunch's registered loader
RAW = "mxlaunch-raw"  # mxlaunch's own snapshot: each rank's tensors before post-processing (every engine)
SHARDED_STATE = "sglang-sharded_state"  # SGLang's own sharded_state dump, one folder per rank
PRESHARDED = "sglang-presharded"  # SGLang's presharded dump: one folder every rank reads (kept as rank 0)
SHARED_FOLDER_FORMATS = (PRESHARDED,)  # formats whose one folder serves every rank (single node only)
# a zygote's files in its folder, one set per key (warmstart/zygote.py starts and uses it; plugin/zygote.py serves)
ZYGOTE_SOCKET, ZYGOTE_INFO, ZYGOTE_REFUSED = ".sock", ".json", ".refused"
# the zygote image handshake (plugin/zygote_dump.py `await_image`, warmstart/zygote_image.py): the zygote stands still and
# says so (.dumpable), the launcher claims it (renamed .dumping) and dumps it; a restore is told where to log (.resume)
ZYGOTE_DUMPABLE, ZYGOTE_DUMPING, ZYGOTE_RESUME = ".dumpable", ".dumping", ".resume"
SNAPSHOT_VERSION = 1  # bump when the raw snapshot's layout changes: old snapshots stop matching
# an engine snapshot's signal protocol (warmstart/engine_tree.py asks, plugin/snapshot_signal.py answers): SIGUSR2
# to an engine process; <dir>/<pid>.action (an order: "sleep", "wake", "sleep-lean", "refill <plan>") turns it into
# that action, reported in <dir>/<pid>.<action>.done, else it releases NVML and reports <dir>/<pid>.released
SNAPSHOT_SIGNAL_NUMBER = 12  # signal.SIGUSR2 on Linux (kept numeric: this module imports nothing)
SNAPSHOT_RELEASED = ".released"
REFILL_METHOD = "mxlaunch_refill"  # the worker method a lean snapshot's refill calls (plugin/weight_refill.py)
FINGERPRINT_METHOD = "mxlaunch_fingerprint"  # ... and the one called before the sleep: the weights' fingerprint


def snapshot_action_path(folder: str, pid: int) -> str:
    return f"{folder}/{pid}.action"


def snapshot_done_path(folder: str, pid: int, action: str) -> str:
    return f"{folder}/{pid}.{action}.done"


def snapshot_format_name(option: str, engine: str) -> str:
    """The store's format name for `--snapshot-format <option>`: raw is mxlaunch's; the others are the
    engine's stock formats, named <engine>-<option>."""
    return RAW if option == "raw" else f"{engine}-{option}"


# ---- strategies ----------------------------------------------------------------------------------------

STRATEGIES = ("p2p", "capture", "staged", "default")  # what a plan file may say
P2P_LAYOUTS = ("raw", "processed")  # what a P2P source serves (transfer/tensor_set.py)
LAUNCH_STRATEGIES = ("auto", *STRATEGIES)  # what `mxlaunch launch --strategy` accepts

# ---- markers (plugin → launcher, in <run_dir>/markers/) ------------------------------------------------

LOADED = "loaded"  # rank R's weights are in place, after post-processing: its staged files can go
CAPTURED = "captured"  # rank R's snapshot files are written into the capture folder
FALLBACK = "fallback"  # rank R serves with the engine's default loader ({"reason"})
MARKER_KINDS = (LOADED, CAPTURED, FALLBACK)
ABORT = "abort.json"  # launcher → plugin: staging failed, stop waiting for files ({"reason"})
RENDEZVOUS_FILE = "rendezvous_file"  # a marker's field: torch.distributed's FileStore file, removed after the run


def marker_name(kind: str, rank: int) -> str:
    return f"{kind}-{rank}.json"


def parse_marker_name(path: Path) -> tuple[str, int] | None:
    """(kind, rank) of a marker file, None for anything else in the folder."""
    kind, _, rank = Path(path).stem.rpartition("-")
    return (kind, int(rank)) if kind in MARKER_KINDS and rank.isdigit() else None


# ---- the lines mxlaunch prints into the engine's log ---------------------------------------------------
# Written by the plugin and the launcher, read by `profile` (engines/base.py's mxlaunch_events). The
# regexes are defined with the engines' log parsers in engines/base.py (one place for every log pattern)
# and re-exported here next to the functions that write the lines; tests/unit check the round trip.

from mxlaunch.engines.base import MXLAUNCH_LOADED as LOADED_LINE  # noqa: E402,F401
from mxlaunch.engines.base import MXLAUNCH_STAGED as STAGED_LINE  # noqa: E402,F401


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


def loaded_line(rank: int, nbytes: int, seconds: float, strategy: str = "staged") -> str:
    """'mxlaunch: rank R loaded N GiB in X s (strategy S)' — parsed by LOADED_LINE."""
    return f"mxlaunch: rank {rank} loaded {gib(nbytes)} GiB in {seconds:.2f} s (strategy {strategy})"


def staged_line(nbytes: int, seconds: float) -> str:
    """'mxlaunch: staged N GiB in X s' — parsed by STAGED_LINE."""
    return f"mxlaunch: staged {gib(nbytes)} GiB in {seconds:.2f} s"
