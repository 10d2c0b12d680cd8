"""Zygote images with a real CRIU (4.1.1 from scripts/kits/build_criu_kit.sh; `make test` builds it when run as root):
a zygote that has imported torch is dumped into the store, restored at once to serve, and restored again, from
the image, after it was stopped — as a node's first start does — and each restored copy forks working engines.

Where CRIU cannot run (not root, no kit) the test is skipped with the reason; as root it must run, so a
missing kit in `make test` is a failure, not a skip."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest

from mxlaunch.warmstart import criu, zygote, zygote_env, zygote_image
from tests.helpers import live_setup
from tests.unit.test_zygote import _env, _stop, module_dir  # noqa: F401 — the fixture

pytestmark = [pytest.mark.e2e, pytest.mark.live_setup]  # tests/helpers/live_setup.py


def usable_criu() -> str:
    live_setup.require("CRIU (the kit make test builds)")
    binary, why = criu.why_not()
    if binary is None:
        if os.geteuid() == 0:
            pytest.fail(f"CRIU must run here as root (make test builds .criu4-kit; MXLAUNCH_CRIU names it): {why}")
        pytest.skip(f"zygote images need CRIU: {why}")
    return binary


def entry(args: tuple[str, ...] = ()) -> zygote.ZygoteEntry:
    """What the zygote imports: torch (a real engine's heaviest import, ~1,000 modules) and the child module."""
    return zygote.ZygoteEntry(os.sys.executable, "module", "mxz_child", args, ("torch",))


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, f"pid {pid} still there"
        time.sleep(0.05)


def test_a_zygote_is_dumped_once_imported_and_restored_to_serve_twice(module_dir: Path) -> None:  # noqa: F811
    binary = usable_criu()
    env = _env(module_dir)
    store = module_dir / "store"
    key = zygote.zygote_key(entry(), "1", env, str(module_dir))
    pid = zygote.start_zygote(key, entry(), env, str(module_dir), module_dir / "logs", for_image=True)
    assert pid is not None
    events: list[tuple[str, dict]] = []
    maker = zygote_image.ImageMaker(binary, pid, key, store, module_dir / "logs" / "zygote.log", module_dir / "criu",
                                    lambda e, **f: events.append((e, f)))
    maker.start()
    maker.join(180)
    try:
        [(name, made)] = events
        assert name == "zygote-image" and made["status"] == "published", made
        assert made["pid"] == pid and made["bytes"] > 50 * 2**20  # torch's heap is in it; its libraries are not
        folder = Path(made["image"])
        image_meta = json.loads((folder / "meta.json").read_text())
        assert folder == zygote_image.image_dir(store, key) and image_meta["pid"] == pid
        touched = {Path(e["path"]).name for e in image_meta["working_set"]}  # its libraries' pages, for a read-ahead
        assert any(name.startswith("libtorch") for name in touched), sorted(touched)[:10]
        assert stat.S_IMODE(os.stat(zygote_image.images_root(store)).st_mode) == 0o700
        assert not any(p.name.startswith(".") for p in zygote_image.images_root(store).iterdir())  # no temp folder left

        child = zygote.fork_from(key, entry(("4",)), {**env, "MX_MARKER": "one"}, str(module_dir))
        assert child is not None and child.wait(timeout=60) == 4
        assert "marker one" in child.stdout.read().decode()

        zygote.socket_path(key).unlink()  # stopped, as `mxlaunch zygotes --stop` does; the image stays
        wait_gone(pid)
        restored = zygote_image.restore_zygote(binary, store, key, module_dir / "logs2" / "zygote.log", module_dir / "criu2")
        assert restored["pid"] == pid and restored["image"] == str(folder)
        assert "read_ahead" in restored, restored  # started before the image staged (warmstart/working_set.py)
        child = zygote.fork_from(key, entry(("6",)), {**env, "MX_MARKER": "two"}, str(module_dir))
        assert child is not None and child.wait(timeout=60) == 6
        assert "marker two" in child.stdout.read().decode()
        assert "restored=yes" in (module_dir / "logs2" / "zygote.log").read_text()  # it logs where the restore said
        assert "restored=yes" in (module_dir / "logs" / "zygote.log").read_text()  # the first restore, by the maker
    finally:
        zygote.socket_path(key).unlink(missing_ok=True)
        _stop(pid)
        wait_gone(pid)


CLOCK_CHILD = '''
import os, time
if __name__ == "__main__":  # the zygote imports this module too
    st = open("/proc/self/stat").read()
    print("start", st[st.rindex(")") + 2:].split()[19], "pid", os.getpid(), flush=True)
    deadline = time.monotonic() + 60  # stay alive until the test has read our /proc entry
    while not os.path.exists(os.environ["MX_RELEASE"]) and time.monotonic() < deadline:
        time.sleep(0.02)
'''


def test_a_restored_zygotes_children_read_the_nodes_clocks(module_dir: Path) -> None:  # noqa: F811
    """CRIU would restore into a time namespace offset by the time since the dump: a child's own view of its
    start time in /proc would then differ from everyone else's, and a P2P source's record read by another
    process looked like a recycled pid ("process gone"). The restored zygote's children must agree with us."""
    binary = usable_criu()
    (module_dir / "mxz_clock.py").write_text(CLOCK_CHILD)
    env = {**_env(module_dir), "MX_RELEASE": str(module_dir / "release")}
    clock = zygote.ZygoteEntry(os.sys.executable, "module", "mxz_clock", (), ("json",))
    key = zygote.zygote_key(clock, "1", env, str(module_dir))
    pid = zygote.start_zygote(key, clock, env, str(module_dir), module_dir / "logs", for_image=True)
    assert pid is not None
    events: list[tuple[str, dict]] = []
    maker = zygote_image.ImageMaker(binary, pid, key, module_dir / "store", module_dir / "logs" / "zygote.log",
                                    module_dir / "criu", lambda e, **f: events.append((e, f)))
    maker.start()
    maker.join(120)
    try:
        assert events and events[0][1]["status"] == "published", events
        assert events[0][1]["pid"] == pid and events[0][1]["restore_s"] > 0, events
        log = module_dir / "logs" / "zygote.log"
        deadline = time.monotonic() + 30  # the restored copy logs its ready line once its socket is published
        while "restored=" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert "restored=yes" in log.read_text(), log.read_text()  # a restored process, not the dumped one let run
        assert not (Path(events[0][1]["image"]) / criu.CLOCKS_IMAGE).exists()
        assert os.readlink(f"/proc/{pid}/ns/time") == os.readlink("/proc/self/ns/time")  # the node's clocks
        child = zygote.fork_from(key, clock, env, str(module_dir))
        assert child is not None
        line = child.stdout.readline().decode().split()
        seen_inside, child_pid = int(line[1]), int(line[3])
        with open(f"/proc/{child_pid}/stat") as f:
            stat_text = f.read()
        (module_dir / "release").touch()
        assert seen_inside == int(stat_text[stat_text.rindex(")") + 2:].split()[19])
        assert child.wait(timeout=60) == 0
    finally:
        zygote.socket_path(key).unlink(missing_ok=True)
        _stop(pid)
        wait_gone(pid)



ENV_CHILD = '''
import os, sys, tempfile
IMPORTED_TMP = tempfile.gettempdir()  # the zygote keeps its import of this module (a child reruns it as __main__), as torch's inductor and dill keep it
if __name__ == "__main__":
    print("env", os.environ["SLURM_JOB_ID"], os.environ["SLURMD_NODENAME"], os.environ["HOSTNAME"],
          os.environ["TMPDIR"], tempfile.gettempdir(), "imported", sys.modules["mxz_env"].IMPORTED_TMP, flush=True)
'''


def job_env(module_dir: Path, job: str, **more: str) -> dict[str, str]:
    tmp = module_dir / f"tmp.{job}"
    tmp.mkdir(exist_ok=True)
    return {**_env(module_dir), "SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_NODELIST": f"gpu[{job}]",
            "SLURMD_NODENAME": f"gpu{job}", "HOSTNAME": f"host{job}", "TMPDIR": str(tmp),
            "VLLM_LOGGING_LEVEL": "INFO", **more}


def test_a_zygote_image_travels_to_a_new_job_and_not_to_changed_imports(module_dir: Path) -> None:  # noqa: F811
    """Issue 42: the image a job left in the store is restored by the next job (new Slurm ids, node, host name
    and TMPDIR: the same key), whose engine sees its own environment, TMPDIR included; a variable the engine
    reads at import (VLLM_LOGGING_LEVEL) changed makes another key, and that job finds no image."""
    binary = usable_criu()
    (module_dir / "mxz_env.py").write_text(ENV_CHILD)
    store, salt = module_dir / "store", zygote_image.key_salt(module_dir / "store")
    ent = zygote.ZygoteEntry(os.sys.executable, "module", "mxz_env", (), ("json",))
    first = job_env(module_dir, "101")
    key = zygote.zygote_key(ent, "1", first, str(module_dir), salt=salt)
    pid = zygote.start_zygote(key, ent, first, str(module_dir), module_dir / "logs", for_image=True)
    assert pid is not None
    events: list[tuple[str, dict]] = []
    maker = zygote_image.ImageMaker(binary, pid, key, store, module_dir / "logs" / "zygote.log", module_dir / "criu",
                                    lambda e, **f: events.append((e, f)))
    maker.start()
    maker.join(120)
    try:
        assert events and events[0][1]["status"] == "published", events
        zygote.socket_path(key).unlink()  # the first job ends: its zygote goes, the image stays in the store
        wait_gone(pid)

        second = job_env(module_dir, "202")
        assert zygote.zygote_key(ent, "1", second, str(module_dir), salt=salt) == key  # the next job's key: a hit
        run = Path(tempfile.mkdtemp(prefix="mxz-run-", dir="/dev/shm"))  # the next job's run folder (0700)
        try:  # the image staged into it, checked as it lands, and CRIU restores that copy (warmstart/image_stage.py)
            restored = zygote_image.restore_zygote(binary, store, key, module_dir / "logs2" / "zygote.log",
                                                   module_dir / "criu2", stage_root=run)
            assert list(run.iterdir()) == []  # the copy is gone once CRIU has read it
        finally:
            shutil.rmtree(run, ignore_errors=True)
        assert restored["pid"] == pid and restored["image_stage_s"] >= 0, restored
        child = zygote.fork_from(key, ent, second, str(module_dir))
        assert child is not None and child.wait(timeout=60) == 0
        tmp = second["TMPDIR"]
        pinned = zygote.zygote_root() / zygote_env.IMPORT_TMPDIR  # the zygote imported under its own TMPDIR
        assert f"env 202 gpu202 host202 {tmp} {tmp} imported {pinned}" in child.stdout.read().decode()

        changed = job_env(module_dir, "303", VLLM_LOGGING_LEVEL="DEBUG")
        other = zygote.zygote_key(ent, "1", changed, str(module_dir), salt=salt)
        assert other != key and zygote_image.check_image(store, other) == (None, "")  # a miss: spawned as always
    finally:
        zygote.socket_path(key).unlink(missing_ok=True)
        _stop(pid)
        wait_gone(pid)
