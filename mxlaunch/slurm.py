"""Slurm's environment → what `mxlaunch launch` needs from it, decided once per node.

One `srun` line starts the same command on every node of a job step; only the process on each node
can tell its place. So inside a multi-node step mxlaunch adds the engine's multi-node flags the command
lacks — node count, this node's rank, the head node's rendezvous address — from Slurm's variables, and
says so. Flags already in the command always win. It also sizes the stage readers to the CPUs Slurm
gave this node when `--readers` was not passed. Pure functions of (argv, environment): no Slurm
commands run, so a login node, a test or a dry run sees exactly what a compute node decides.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence

from mxlaunch import settings
from mxlaunch.errors import UsageError

ADDR_ENV = settings.DIST_ADDR  # the head's address as the other nodes reach it (default: first node's name)
PORT_ENV = settings.DIST_PORT  # the rendezvous port (default: derived from the job id)
PORT_BASE, PORT_SPAN = 21000, 8000  # 21000–28999: clear of vLLM's 29500/29501 defaults and ephemeral ports

# The multi-node flags per engine, each with the spellings its parser accepts (an explicit one wins);
# for SGLang its argv module tells which fields a command sets (engines/sglang_argv.explicit_fields).
_VLLM = {"nnodes": ("--nnodes", "-n"), "node_rank": ("--node-rank", "-r"), "master_addr": ("--master-addr",),
         "master_port": ("--master-port",), "headless": ("--headless",)}
_SGLANG = ("nnodes", "node_rank", "dist_init_addr")
_VLLM_API_SERVER = "vllm.entrypoints.openai.api_server"


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

    @property
    def message(self) -> str:
        return "; ".join(self.notes)

    def to_json(self) -> Optional[dict]:
        """The plan's "slurm" record (None outside Slurm)."""
        if self.env is None:
            return None
        env = self.env
        return {"job_id": env.job_id, "nnodes": env.nnodes, "node_rank": env.node_rank, "head": env.head,
                "nodes": list(env.nodes), "in_step": env.in_step, "cpus_on_node": env.cpus_on_node,
                "readers": self.readers, "added": list(self.added), "message": self.message}


def adapt_launch(argv: Sequence[str], engine: Optional[str], readers: Optional[int] = None,
                 environ: Mapping[str, str] = os.environ) -> SlurmLaunch:
    """argv with the multi-node flags Slurm implies (for `engine` "vllm" | "sglang"), and the readers.

    Flags are added only inside an srun step over more than one node — the batch script of a
    multi-node job runs on the first node alone, and adding `--nnodes` there would make the engine
    wait for nodes that never come. Each flag is decided on its own: one the command has (or its
    `--config` file sets) is kept as it is."""
    argv = list(argv)
    env = read_env(environ)
    if env is None:
        return SlurmLaunch(argv, readers if readers is not None else default_readers())
    out = SlurmLaunch(argv, readers if readers is not None else default_readers(), env)
    if readers is None and env.cpus_on_node:
        out.readers = readers_for(env.cpus_on_node)
        out.notes.append(f"{out.readers} stage readers for SLURM_CPUS_ON_NODE={env.cpus_on_node}")
    if env.nnodes > 1 and not env.in_step:
        out.notes.append(f"job {env.job_id} has {env.nnodes} nodes but this runs outside srun, on this node alone "
                         "(start one mxlaunch per node with srun: slurm/launch-multinode.sbatch)")
        return out
    if env.nnodes == 1 or engine not in ("vllm", "sglang"):
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
    """The flags to append to `argv` so the engine runs as node `env.node_rank` of `env.nnodes`.

    SGLang: --nnodes N --node-rank R --dist-init-addr HEAD:PORT. vLLM (0.32's mp backend, checked in
    vllm/engine/arg_utils.py): --nnodes N --node-rank R --master-addr HEAD --master-port PORT, and
    --headless on the other nodes (they run workers only, no API server)."""
    if engine == "sglang":  # SGLang's own rules: aliases, argparse abbreviations, its --config file
        from mxlaunch.engines.sglang_argv import explicit_fields

        given = {k: ("" if v is True else str(v)) for k, v in explicit_fields(list(argv)).items() if k in _SGLANG}
    else:
        given = given_flags(argv, _VLLM, read_config=True)
    nnodes = _as_int(given.get("nnodes"), env.nnodes)
    if nnodes <= 1:
        return []  # the command says one node: it wins
    node_rank = _as_int(given.get("node_rank"), env.node_rank)
    addr = settings.dist_addr(environ) or env.head
    port = dist_port(env, environ)
    add: List[str] = []
    if "nnodes" not in given:
        add += ["--nnodes", str(env.nnodes)]
    if "node_rank" not in given:
        add += ["--node-rank", str(env.node_rank)]
    if engine == "sglang":
        if "dist_init_addr" not in given:
            add += ["--dist-init-addr", f"{addr}:{port}"]
        return add
    if "master_addr" not in given:
        add += ["--master-addr", addr]
    if "master_port" not in given:
        add += ["--master-port", str(port)]
    if node_rank > 0 and "headless" not in given:
        if _VLLM_API_SERVER in argv:
            raise UsageError(f"node {node_rank} of a multi-node vLLM run must start headless, and "
                             f"`python -m {_VLLM_API_SERVER}` ignores --headless",
                             "use `vllm serve MODEL ...` in multi-node jobs")
        add.append("--headless")
    return add


def given_flags(argv: Sequence[str], table: Mapping[str, tuple], read_config: bool = False) -> dict:
    """{key: value} for the flags of `table` that `argv` sets ('' for a flag without a value).

    Reads `--flag value`, `--flag=value`, `_` for `-` in long names and `-r1` short forms; with
    `read_config`, also the keys of a `--config FILE.yaml` (both engines read one; the command line
    still wins over it there)."""
    spellings = {}
    for key, names in table.items():
        for name in names:
            spellings[name] = key
    found: dict = {}
    if read_config:
        found.update(_config_keys(argv, table))
    tokens = list(argv)
    for i, tok in enumerate(tokens):
        if not tok.startswith("-") or tok == "--":
            continue
        head, eq, value = tok.partition("=")
        if head.startswith("--"):
            head = "--" + head[2:].replace("_", "-")
        key = spellings.get(head)
        if key is None and not head.startswith("--"):
            m = re.fullmatch(r"(-[a-z])(\d+)", tok)  # -r1, -n2
            if m and m.group(1) in spellings:
                found[spellings[m.group(1)]] = m.group(2)
            continue
        if key is None:
            continue
        if eq:
            found[key] = value
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
            found[key] = tokens[i + 1]
        else:
            found[key] = ""
    return found


def _config_keys(argv: Sequence[str], table: Mapping[str, tuple]) -> dict:
    """Keys of the engine's `--config FILE.yaml` that name a multi-node flag (unreadable: none — the
    engine's argv parser reports a bad file with its own one-line error)."""
    path = next((argv[i + 1] for i, t in enumerate(argv[:-1]) if t == "--config"), None)
    if path is None:
        return {}
    try:
        import yaml

        with open(path) as fh:
            data = yaml.safe_load(fh)
    except Exception:  # noqa: BLE001 — unreadable or not YAML: yaml's errors are many
        return {}
    if not isinstance(data, dict):
        return {}
    found = {}
    for name, value in data.items():
        key = str(name).replace("-", "_")
        if key in table:
            found[key] = "" if value is True else str(value)
    return found


def _as_int(text: Optional[str], default: int) -> int:
    try:
        return int(text) if text else default
    except ValueError:
        return default  # the engine's own parser rejects it with its message
