"""The run folder and the other names mxlaunch keeps in /dev/shm, attacked by a real second user (issue 41,
docs/security.md "The run folder in /dev/shm").

The shared place is a stand-in folder in /dev/shm made like /dev/shm itself (root's, 1777: anyone may create a
name, only its owner may rename or remove it), so that the intruder (tests/helpers/second_user.py, a real uid)
reaches it; the code under test is pointed at it through the modules' SHM_ROOT. The victim is this process.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from mxlaunch.fileutil import mark_used
from mxlaunch.launch import cleanup
from mxlaunch.warmstart import zygote
from mxlaunch.plan import Plan, PlanError, load_plan, write_marker
from mxlaunch.plugin import snapshot_signal
from mxlaunch.safety.ownership import ForeignPath, own_dir, untrusted_path
from tests.helpers.second_user import User, intruder, tree  # noqa: F401 — the fixture

PY = sys.executable


@pytest.fixture
def shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A /dev/shm stand-in every user can reach: root's (this process's), 1777, inside /dev/shm."""
    root = Path(tempfile.mkdtemp(prefix="mx41-", dir="/dev/shm"))
    os.chmod(root, 0o1777)
    monkeypatch.setattr(cleanup, "SHM_ROOT", root)
    monkeypatch.setattr(zygote, "SHM_ROOT", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def dead_pid() -> int:
    proc = subprocess.Popen([PY, "-c", "pass"])
    proc.wait()
    return proc.pid


def squat_user_root(user: User, shm: Path, victim_segment: Path) -> Path:
    """Attack (a): the intruder makes /dev/shm/mxlaunch-<victim uid> first (0777), with a dead "run" whose
    segments.json names the victim's segment (its name and inode: anyone can stat it)."""
    squatted = shm / f"mxlaunch-{os.getuid()}"
    user.python(f"""
        import json, os
        root = {str(squatted)!r}
        os.mkdir(root); os.chmod(root, 0o777)
        run = os.path.join(root, "job1-20260101-000000-aaaaaa")
        os.mkdir(run); os.chmod(run, 0o777)
        with open(os.path.join(run, "owner.json"), "w") as f:
            json.dump({{"pid": {dead_pid()}, "start_time": 1}}, f)
        with open(os.path.join(run, "segments.json"), "w") as f:
            json.dump({{"segments": [{{"name": {victim_segment.name!r}, "ino": {victim_segment.stat().st_ino if victim_segment.exists() else None}}}]}}, f)
    """)
    return squatted


# ---- (a) the user's folder squatted before the first run --------------------------------------------------


def test_a_squatted_user_folder_gets_a_private_fallback_and_its_planted_segments_json_deletes_nothing(
        shm: Path, intruder: User) -> None:
    victim_segment = shm / "psm_victim01"
    victim_segment.write_bytes(b"v" * 4096)  # this uid's, unused: exactly what a believed record would remove
    squatted = squat_user_root(intruder, shm, victim_segment)
    old_run = squatted / "job0-20251231-000000-000000"  # a dead run of the victim's, made there by older code
    old_run.mkdir(mode=0o700)
    (old_run / "owner.json").write_text(json.dumps({"pid": dead_pid(), "start_time": 1}))
    (old_run / cleanup.SEGMENTS).write_text(json.dumps({"segments": [{"name": victim_segment.name, "ino": None}]}))
    before = tree(squatted)

    root, why = cleanup.user_root()
    assert root != squatted and root.parent == shm and root.name.startswith(f"{squatted.name}.")
    st = root.lstat()
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert why is not None and str(squatted) in why and f"uid {intruder.uid}" in why
    assert cleanup.user_root() == (root, why)  # every launch of this user on the node agrees on the fallback
    assert cleanup.user_roots() == [root]  # the squatted name is never looked into

    assert cleanup.reap_all_stale_runs() == []
    assert cleanup.reap_stale_runs(squatted) == []  # even when handed the squatted folder itself
    assert victim_segment.exists()
    assert tree(squatted) == before  # nothing removed from it, nothing written into it


def test_the_fallback_is_reaped_like_the_usual_folder(shm: Path, intruder: User) -> None:
    """A launcher killed while it ran in the fallback: the next launch finds its run folder and segments."""
    squat_user_root(intruder, shm, shm / "psm_none")
    root, _ = cleanup.user_root()
    run = root / "job2-20260101-000000-bbbbbb"
    run.mkdir(mode=0o700)
    (run / "owner.json").write_text(json.dumps({"pid": dead_pid(), "start_time": 1}))
    segment = shm / "psm_mine0001"
    segment.write_bytes(b"x" * 4096)
    cleanup.SegmentRecord(run, before=set(os.listdir(shm)) - {segment.name}).update(force=True)
    assert cleanup.reap_all_stale_runs() == [(run, [segment.name])]
    assert not run.exists() and not segment.exists() and root.is_dir()


def test_a_segments_json_this_user_does_not_own_is_never_believed(shm: Path, intruder: User) -> None:
    """In this user's own folder, a run folder holding another uid's segments.json (and owner.json)."""
    root, why = cleanup.user_root()
    assert why is None and root == shm / f"mxlaunch-{os.getuid()}"
    victim_segment = shm / "psm_victim02"
    victim_segment.write_bytes(b"v" * 4096)
    run = root / "job3-20260101-000000-cccccc"
    run.mkdir(mode=0o700)
    for name, doc in (("owner.json", {"pid": dead_pid(), "start_time": 1}),
                      (cleanup.SEGMENTS, {"segments": [{"name": victim_segment.name, "ino": None}]})):
        (run / name).write_text(json.dumps(doc))
        os.chown(run / name, intruder.uid, intruder.gid)
    os.utime(run, (0, 0))  # an old folder whose owner.json is not believed either: stale by its age
    assert cleanup.reap_all_stale_runs() == [(run, [])]  # the dead run goes, the segment it "recorded" stays
    assert victim_segment.exists()


def test_a_recorded_segment_of_another_uid_is_never_removed(shm: Path, intruder: User) -> None:
    root, _ = cleanup.user_root()
    run = root / "job4-20260101-000000-dddddd"
    run.mkdir(mode=0o700)
    (run / "owner.json").write_text(json.dumps({"pid": dead_pid(), "start_time": 1}))
    theirs = shm / "psm_theirs01"
    intruder.python(f"open({str(theirs)!r}, 'wb').write(b't' * 4096)")
    (run / cleanup.SEGMENTS).write_text(json.dumps({"segments": [{"name": theirs.name, "ino": theirs.stat().st_ino}]}))
    assert cleanup.reap_all_stale_runs() == [(run, [])]
    assert theirs.exists() and theirs.stat().st_uid == intruder.uid


def test_a_dev_shm_anyone_may_rename_in_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loose = tmp_path / "shm"
    loose.mkdir()
    os.chmod(loose, 0o777)  # world-writable, no sticky bit
    monkeypatch.setattr(cleanup, "SHM_ROOT", loose)
    with pytest.raises(ForeignPath) as caught:
        cleanup.user_root()
    assert str(loose) in caught.value.one_line() and "chmod +t" in caught.value.one_line()


# ---- (b) the run folder or plan.json swapped --------------------------------------------------------------


def write_plan(run: Path, **fields: object) -> Path:
    plan = Plan(strategy="staged", source_id="0" * 16, run_dir=str(run), **fields)  # type: ignore[arg-type]
    path = run / "plan.json"
    path.write_text(plan.to_json())
    os.chmod(path, 0o600)
    return path


def test_the_intruder_cannot_swap_the_run_folder_or_its_plan(shm: Path, intruder: User) -> None:
    root, _ = cleanup.user_root()
    run = root / "job5-20260101-000000-eeeeee"
    run.mkdir(mode=0o700)
    path = write_plan(run)
    tried = intruder.python(f"""
        import errno, os
        evil = {str(shm / "evil.json")!r}
        open(evil, "w").write("{{}}")
        for name, step in (("rename run", lambda: os.rename({str(run)!r}, {str(root / "x")!r})),
                           ("rename root", lambda: os.rename({str(root)!r}, {str(shm / "x")!r})),
                           ("replace plan", lambda: os.rename(evil, {str(path)!r})),
                           ("new run", lambda: os.mkdir({str(root / "job6")!r}))):
            try:
                step()
                print(name, "DONE")
            except OSError as exc:
                print(name, errno.errorcode[exc.errno])
    """, check=False)
    assert "DONE" not in tried.stdout and tried.stdout.count("\n") == 4, tried.stdout + tried.stderr
    plan = load_plan(path)
    assert plan is not None and plan.run_dir == str(run)


def test_the_plugin_refuses_a_plan_in_a_folder_another_user_holds(shm: Path, intruder: User) -> None:
    """The old attack: the user's folder squatted, the victim's run folder (and plan) in it; the intruder then
    renames it away and puts a run folder with a plan of its own under the same name."""
    squatted = squat_user_root(intruder, shm, shm / "psm_none")
    run = squatted / "job7-20260101-000000-ffffff"
    run.mkdir(mode=0o700)
    path = write_plan(run)
    with pytest.raises(PlanError, match=rf"refused: {squatted} belongs to uid {intruder.uid}"):
        load_plan(path)  # the victim's own plan file, but under a folder someone else can swap

    intruder.python(f"""
        import os, json
        os.rename({str(run)!r}, {str(squatted / "moved")!r})
        os.mkdir({str(run)!r}, 0o755)
        with open({str(path)!r}, "w") as f:
            f.write(json.dumps({{"schema": 1, "strategy": "staged", "source_id": "0" * 16, "run_dir": {str(run)!r},
                                "ranks": {{"0": [{{"path": "/intruder/weights.safetensors", "bytes": 8}}]}}}}))
    """)
    with pytest.raises(PlanError, match="refused"):
        load_plan(path)


def test_a_plan_others_can_write_a_linked_plan_or_a_foreign_run_dir_is_refused(shm: Path, intruder: User) -> None:
    root, _ = cleanup.user_root()
    run = root / "job8-20260101-000000-aaaaaa"
    run.mkdir(mode=0o700)
    path = write_plan(run)
    os.chmod(path, 0o666)
    with pytest.raises(PlanError, match="writable by others"):
        load_plan(path)
    os.chmod(path, 0o600)
    link = run / "link.json"
    link.symlink_to(path)
    with pytest.raises(PlanError, match="not a regular file"):
        load_plan(link)
    theirs = shm / "theirs-run"
    intruder.python(f"import os; os.mkdir({str(theirs)!r}, 0o755)")
    path.write_text(Plan(strategy="capture", source_id="0" * 16, run_dir=str(theirs)).to_json())
    with pytest.raises(PlanError, match=rf"its run folder {theirs} belongs to uid {intruder.uid}"):
        load_plan(path)  # markers (and a capture through /dev/shm) would go into the intruder's folder


def test_markers_never_go_through_a_planted_link(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    plan = Plan(strategy="staged", source_id="0" * 16, run_dir=str(run))
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (run / "markers").symlink_to(tmp_path)  # a markers "folder" that is a link
    with pytest.raises(ForeignPath, match="not a real folder"):
        write_marker(plan, "loaded", 0, {})
    (run / "markers").unlink()
    own_dir(run / "markers")
    (run / "markers" / "loaded-0.json").symlink_to(victim)
    written = write_marker(plan, "loaded", 0, {"bytes": 1})
    assert victim.read_text() == "mine" and not written.is_symlink()
    assert stat.S_IMODE(written.stat().st_mode) & 0o077 == 0  # private


# ---- (c) links planted where the engine writes ----------------------------------------------------------


def test_the_snapshot_handler_writes_through_no_planted_link_and_refuses_a_folder_others_write(
        shm: Path, intruder: User, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.plugin import zygote_dump as plugin_zygote

    monkeypatch.setattr(plugin_zygote, "release_nvml", lambda: None)
    monkeypatch.setattr(plugin_zygote, "device_files", lambda: [])
    folder = shm / "marks"  # sticky and open to all, like the shared place itself: the intruder plants there
    folder.mkdir()
    os.chmod(folder, 0o1777)
    assert snapshot_signal.install({"MXLAUNCH_SNAPSHOT_DIR": str(folder)}) is False  # others can write it
    victim = shm / "victim-file"
    victim.write_text("mine")
    os.chmod(victim, 0o666)  # the intruder may point at it, never change it through us
    tmp = snapshot_signal.report_path(str(folder), os.getpid()) + ".tmp"
    intruder.python(f"import os; os.symlink({str(victim)!r}, {tmp!r})")
    report = snapshot_signal.release_and_report(str(folder))
    assert "error" not in report, report
    assert victim.read_text() == "mine"
    written = Path(snapshot_signal.report_path(str(folder), os.getpid()))
    assert not written.is_symlink() and json.loads(written.read_text()) == {"pid": os.getpid(), "device_files": []}


def test_mark_used_follows_no_planted_last_used_link(shm: Path, intruder: User) -> None:
    """A store folder others can write (a group store, here sticky and open to all): `.last-used` planted as a
    link to a file of the victim's that does not exist yet (touch would create it) and to one that does."""
    folder = shm / "snapshot"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    absent = shm / "victim-absent"
    intruder.python(f"import os; os.symlink({str(absent)!r}, {str(folder / '.last-used')!r})")
    mark_used(folder)
    assert not absent.exists() and (folder / ".last-used").is_symlink()
    present = shm / "victim-present"
    present.write_text("mine")
    os.utime(present, (1_000_000, 1_000_000))
    intruder.python(f"import os; os.remove({str(folder / '.last-used')!r}); "
                    f"os.symlink({str(present)!r}, {str(folder / '.last-used')!r})")
    mark_used(folder)
    assert present.stat().st_mtime == 1_000_000
    own = shm / "mine"
    own.mkdir()
    mark_used(own)  # the plain case still stamps
    assert (own / ".last-used").is_file() and not (own / ".last-used").is_symlink()


# ---- the zygote root ----------------------------------------------------------------------------------


def test_a_squatted_zygote_root_gets_a_private_fallback_and_zygote_images_are_off(shm: Path, intruder: User) -> None:
    squatted = shm / f"mxlaunch-zygote-{os.getuid()}"
    intruder.python(f"""
        import json, os
        os.mkdir({str(squatted)!r}); os.chmod({str(squatted)!r}, 0o777)
        with open({str(squatted / "k1.json")!r}, "w") as f:
            json.dump({{"pid": 1, "entry": ["evil"], "started": 0}}, f)
        os.symlink("/etc/passwd", {str(squatted / "k1.sock")!r})
    """)
    before = tree(squatted)
    root = zygote.zygote_root()
    assert root != squatted and root.name.startswith(f"{squatted.name}.") and zygote.private_root()
    assert zygote.zygote_root() == root  # the same fallback each time: zygotes found again
    assert zygote.socket_path("k1").parent == root
    assert zygote.list_zygotes() == [] and zygote.stop_zygotes() == []  # the intruder's files are not ours
    why = zygote.image_blocker()
    assert why is not None and str(squatted) in why and f"uid {intruder.uid}" in why
    assert tree(squatted) == before


def test_an_own_zygote_root_keeps_its_name_and_images(shm: Path) -> None:
    assert zygote.zygote_root() == shm / f"mxlaunch-zygote-{os.getuid()}"
    assert zygote.image_blocker() is None


def test_untrusted_path_accepts_the_usual_chain(shm: Path) -> None:
    root, _ = cleanup.user_root()
    run = root / "r"
    run.mkdir(mode=0o700)
    assert untrusted_path(write_plan(run), is_dir=False) is None
    assert untrusted_path(run, is_dir=True) is None


# ---- kept staged snapshots (launch --keep-staged, staging/kept.py) ----------------------------------------

def test_a_kept_snapshot_planted_in_a_squatted_user_folder_is_never_linked(shm: Path, intruder: User) -> None:
    """The intruder makes /dev/shm/mxlaunch-<victim uid> first and plants kept/<source id>/ with files.json
    and a weight file of the name and size the victim's plan asks for (its bytes the intruder's, its recorded
    checksum copied from the plan): the victim's launches keep in their private fallback, and even handed the
    squatted folder, reuse links nothing, `available` counts nothing, and evict/drop remove nothing of it."""
    from mxlaunch.staging import kept

    squatted = squat_user_root(intruder, shm, shm / "psm_none")
    want = {"0/model-00001.safetensors": {"bytes": 4096, "xxh3_128": "0123456789abcdef0123456789abcdef"}}
    intruder.python(f"""
        import json, os
        entry = os.path.join({str(squatted)!r}, "kept", "sid1")
        os.makedirs(os.path.join(entry, "0"), mode=0o700)
        os.chmod(os.path.join({str(squatted)!r}, "kept"), 0o700)
        with open(os.path.join(entry, "files.json"), "w") as f:
            json.dump({want!r}, f)  # the real format: rel -> bytes and checksum
        with open(os.path.join(entry, "0", "model-00001.safetensors"), "wb") as f:
            f.write(b"P" * 4096)
    """)
    before = tree(squatted)
    root, why = cleanup.user_root()
    assert root != squatted and why is not None
    assert kept.entries(root) == [] and kept.available(root, "sid1", want) == 0

    dest = shm / "victim-stage"
    dest.mkdir(mode=0o700)
    got = kept.reuse(squatted, "sid1", want, dest)
    assert got.rels == [] and got.bytes == 0 and list(dest.rglob("*")) == []
    assert kept.available(squatted, "sid1", want) == 0
    assert kept.evict(squatted, 1 << 40) == []
    kept.drop(squatted, "sid1")
    assert tree(squatted) == before  # nothing of the intruder's removed, nothing written into it
