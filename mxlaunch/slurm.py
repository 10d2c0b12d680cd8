"""Slurm's environment → what `mxlaunch launch` needs from it, decided once per node.

One `srun` line starts the same command on every node of a job step; only the process on each node
can tell its place. So inside a multi-node step mxlaunch adds the engine's multi-node flags the command
lacks — node count, this node's rank, the head node's rendezvous address — from Slurm's variables, and
says so. Flags already in the command always win. It also sizes the stage readers to the CPUs Slurm
gave this node when `--readers` was not passed. Pure functions of (argv, environment): no Slurm
commands run, so a login node, a test or a dry run sees exactly what a compute node decides — with one
exception at the end: `kill_wait()` asks `scontrol show config` for Slurm's KillWait, the seconds
between the SIGTERM of a cancelled job and its SIGKILL, which bounds how long the launcher may take to
stop (mxlaunch/launch/shutdown.py); its parser is pure.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence

from mxlaunch import settings
from mxlaunch.engines.registry import ENGINES
from mxlaunch.errors import UsageError

ADDR_ENV = settings.DIST_ADDR  # the head's address as the other nodes reach it (default: first node's name)
PORT_ENV = settings.DIST_PORT  # the rendezvous port (default: derived from the job id)
PORT_BASE, PORT_SPAN = 21000, 8000  # 21000–28999: clear of vLLM's 29500/29501 defaults and ephemeral ports



# ---- the hostlist syntax ---------------------------------------------------------------------------


def expand_hostlist(text: str) -> List[str]:
    """Slurm's compressed host list → names, in Slurm's order (as `scontrol show hostnames` prints them).

    `gpu[01-03,07],login1` → gpu01 gpu02 gpu03 gpu07 login1; zero padding is kept per range
    (`n[8-10]` → n8 n9 n10); several bracket groups multiply (`r[1-2]n[1-2]` → r1n1 r1n2 r2n1 r2n2).
    Done here rather than by `scontrol` so the launcher needs no Slurm client on the node."""
    text = text.strip()
    if not text:
        raise UsageError("the Slurm node list is empty", "run inside a Slurm job (SLURM_JOB_NODELIST is set there)")
    hosts: List[str] = []
    for item in _split_top(text):
        hosts.extend(_expand_item(item, text))
    return hosts


def _split_top(text: str) -> List[str]:
    """Split at commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _bad_list(text, "nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _bad_list(text, "a ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _bad_list(text, "a '[' without ']'")
    items.append(text[start:])
    if any(not item for item in items):
        raise _bad_list(text, "an empty name")
    return items


def _expand_item(item: str, whole: str) -> List[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand_item(rest, whole) if rest else [""]
    out = []
    for num in _expand_ranges(ranges, whole):
        out.extend(prefix + num + tail for tail in tails)
    return out


def _expand_ranges(ranges: str, whole: str) -> List[str]:
    out: List[str] = []
    for part in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise _bad_list(whole, f"{part!r} is not a number or a range like 01-04")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise _bad_list(whole, f"the range {part!r} runs backwards")
        width = len(lo_text) if lo_text.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _bad_list(text: str, problem: str) -> UsageError:
    return UsageError(f"cannot read the Slurm node list {text!r}: {problem}",
                      "check SLURM_JOB_NODELIST / SLURM_STEP_NODELIST (scontrol show hostnames expands it)")


# ---- the environment -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmEnv:
    """This process's place in a Slurm job.

    Inside an srun step (`in_step`) the node count, list and task count are the step's — the nodes
    that run this very command; in the batch script itself they are the job's."""

    job_id: str
    nnodes: int
    node_rank: int
    nodes: tuple
    cpus_on_node: Optional[int]
    in_step: bool
    ntasks: Optional[int]

    @property
    def head(self) -> str:
        return self.nodes[0]


def read_env(environ: Mapping[str, str] = os.environ) -> Optional[SlurmEnv]:
    """The Slurm job this process runs in, or None outside one (no SLURM_JOB_ID)."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None
    in_step = bool(environ.get("SLURM_STEP_NUM_NODES"))
    if in_step:
        nnodes_var = "SLURM_STEP_NUM_NODES"
        list_var = "SLURM_STEP_NODELIST" if environ.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    else:
        nnodes_var = next((v for v in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES") if environ.get(v)), "SLURM_NNODES")
        list_var = "SLURM_JOB_NODELIST" if environ.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    nnodes = _env_int(environ, nnodes_var, 1, minimum=1)
    node_rank = _env_int(environ, "SLURM_NODEID", 0, minimum=0)
    nodes = tuple(expand_hostlist(environ[list_var])) if environ.get(list_var) else (
        environ.get("SLURMD_NODENAME") or os.uname().nodename,)
    if len(nodes) != nnodes:
        raise UsageError(f"Slurm says {nnodes} node(s) ({nnodes_var}) but {list_var} names {len(nodes)}",
                         "run mxlaunch under the job's own srun/sbatch environment, unmodified")
    if node_rank >= nnodes:
        raise UsageError(f"SLURM_NODEID={node_rank} is not below the node count {nnodes} ({nnodes_var})",
                         "run mxlaunch under the job's own srun/sbatch environment, unmodified")
    cpus = _env_int(environ, "SLURM_CPUS_ON_NODE", 0, minimum=1) if environ.get("SLURM_CPUS_ON_NODE") else None
    ntasks = _env_int(environ, "SLURM_STEP_NUM_TASKS", 1, minimum=1) if in_step and environ.get("SLURM_STEP_NUM_TASKS") else None
    return SlurmEnv(job_id=job_id, nnodes=nnodes, node_rank=node_rank, nodes=nodes, cpus_on_node=cpus,
                    in_step=in_step, ntasks=ntasks)


def job_capture_id(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The capture id every node of this job step shares, or None outside Slurm.

    `slurm-<job>-<step>` (step `batch` in the batch script itself), with `-r<n>` after the n-th requeue:
    the same on every node of one `srun`, different for the next step, job or requeued attempt. A
    snapshot captured by several nodes is written under this id, and the claim holder's id says which
    nodes belong to its capture."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job:
        return None
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "batch"
    restart = environ.get("SLURM_RESTART_COUNT", "0").strip()
    text = f"slurm-{job}-{step}" + (f"-r{restart}" if restart not in ("", "0") else "")
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:128]


def _env_int(environ: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    text = environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise UsageError(f"{name}={text!r} is not a whole number ≥ {minimum}",
                         "run mxlaunch under the job's own srun/sbatch environment, unmodified")
    return value


def default_readers() -> int:
    """The stage command's default reader count (mxlaunch.stage), also launch's outside Slurm."""
    from mxlaunch.stage import default_readers as stage_default  # staging code, loaded when needed

    return stage_default()


def readers_for(cpus: int) -> int:
    """Stage readers for a node with `cpus` CPUs: 2 per CPU, at least 4, at most the stage default.

    Readers mostly wait on I/O, so a few more than CPUs keep requests in flight; on the 2-core
    benchmark box 4 cost least CPU per GiB, while a large node gets the default that was best on the
    benchmarked disks (docs/benchmarks.md). A job with few CPUs should not run 32 reader threads."""
    return max(4, min(default_readers(), 2 * cpus))


def dist_port(env: SlurmEnv, environ: Mapping[str, str] = os.environ) -> int:
    """The rendezvous port: $MXLAUNCH_DIST_PORT, else one derived from the job id — every node of the
    job computes the same one, and two jobs sharing a head node rarely collide."""
    text = settings.dist_port(environ)
    if text:
        if not text.isdigit() or not 1024 <= int(text) <= 65535:
            raise UsageError(f"{PORT_ENV}={text!r} is not a port number 1024–65535", f"set {PORT_ENV} to a free port, or unset it")
        return int(text)
    digits = re.sub(r"\D", "", env.job_id) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


# ---- the decision ----------------------------------------------------------------------------------


@dataclass
class SlurmLaunch:
    """What Slurm changes about one launch: the command, the reader count, and why."""

    argv: List[str]
    readers: int
    env: Optional[SlurmEnv] = None
    added: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    capture_id: Optional[str] = None  # shared by every node of the job step (job_capture_id)

    @property
    def message(self) -> str:
        return "; ".join(self.notes)

    def to_json(self) -> Optional[dict]:
        """The plan's "slurm" record (None outside Slurm)."""
        if self.env is None:
            return None
        env = self.env
        return {"job_id": env.job_id, "nnodes": env.nnodes, "node_rank": env.node_rank, "head": env.head,
                "capture_id": self.capture_id,
                "nodes": list(env.nodes), "in_step": env.in_step, "cpus_on_node": env.cpus_on_node,
                "readers": self.readers, "added": list(self.added), "message": self.message}


def adapt_launch(argv: Sequence[str], engine: Optional[str], readers: Optional[int] = None,
                 environ: Mapping[str, str] = os.environ) -> SlurmLaunch:
    """argv with the multi-node flags Slurm implies (for `engine`, a registry name), and the readers.

    Flags are added only inside an srun step over more than one node — the batch script of a
    multi-node job runs on the first node alone, and adding `--nnodes` there would make the engine
    wait for nodes that never come. Each flag is decided on its own: one the command has (or its
    `--config` file sets) is kept as it is."""
    argv = list(argv)
    env = read_env(environ)
    if env is None:
        return SlurmLaunch(argv, readers if readers is not None else default_readers())
    out = SlurmLaunch(argv, readers if readers is not None else default_readers(), env, capture_id=job_capture_id(environ))
    if readers is None and env.cpus_on_node:
        out.readers = readers_for(env.cpus_on_node)
        out.notes.append(f"{out.readers} stage readers for SLURM_CPUS_ON_NODE={env.cpus_on_node}")
    if env.nnodes > 1 and not env.in_step:
        out.notes.append(f"job {env.job_id} has {env.nnodes} nodes but this runs outside srun, on this node alone "
                         "(start one mxlaunch per node with srun: slurm/launch-multinode.sbatch)")
        return out
    if env.nnodes == 1 or engine not in ENGINES:
        return out
    if env.ntasks is not None and env.ntasks != env.nnodes:
        raise UsageError(f"srun started {env.ntasks} tasks on {env.nnodes} nodes; mxlaunch launch runs once per node",
                         "use srun --ntasks-per-node=1 (the engine starts its own workers)")
    out.added = multinode_flags(argv, engine, env, environ)
    out.argv = argv + out.added
    if out.added:
        out.notes.append(f"added {' '.join(out.added)} (node {env.node_rank} of {env.nnodes} in Slurm job {env.job_id})")
    else:
        out.notes.append("the command already has its multi-node flags; kept them")
    return out


def multinode_flags(argv: Sequence[str], engine: str, env: SlurmEnv,
                    environ: Mapping[str, str] = os.environ) -> List[str]:
    """The flags to append to `argv` so the engine runs as node `env.node_rank` of `env.nnodes`: the
    engine decides which (engines/protocol.py `multinode_flags`), with the head's address and the port."""
    addr = settings.dist_addr(environ) or env.head
    return ENGINES[engine].multinode_flags(argv, env.nnodes, env.node_rank, addr, dist_port(env, environ))


# ---- KillWait: how long a stop may take ---------------------------------------------------------------

_KILL_WAIT = re.compile(r"^KillWait\s*=\s*(\d+)\s*(?:sec)?\s*$", re.MULTILINE)


def parse_kill_wait(text: str) -> Optional[int]:
    """Seconds from `scontrol show config` output ("KillWait                = 30 sec"), or None."""
    m = _KILL_WAIT.search(text)
    return int(m.group(1)) if m else None


def kill_wait(timeout: float = 5.0) -> Optional[int]:
    """This cluster's KillWait from `scontrol show config` (None: no scontrol, no answer, no such line)."""
    try:
        proc = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_kill_wait(proc.stdout) if proc.returncode == 0 else None
