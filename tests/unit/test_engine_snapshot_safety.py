"""The engine snapshot on a shared node (issue 41, items 4 and 5; docs/security.md): the key follows every
variable but the run-only ones and writes no secret down; the post-dump step takes from /dev/shm only the
link-remap files of this user's that the frozen tree holds; a restore puts files back only as new names.
The /dev/shm attacks are made by a real second user (tests/helpers/second_user.py; CI runs as root)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from mxlaunch.warmstart import engine_snapshot as es
from mxlaunch.warmstart import engine_tree, snapshot_restore, snapshot_take
from mxlaunch.warmstart import engine_snapshots
from mxlaunch.warmstart.engine_snapshots import EngineSnapshots
from mxlaunch.warmstart.snapshot_key import RUN_ONLY, key_facts, key_salt, snapshot_key
from mxlaunch.safety.ownership import ForeignPath
from tests.helpers.second_user import User, intruder  # noqa: F401 (a fixture)

SHM = Path("/dev/shm")
ARGV = ["vllm", "serve", "m", "--port", "8000"]
SALT = b"s" * 32


# ---- the key ---------------------------------------------------------------------------------------------


def key(argv: list[str] = ARGV, env: dict[str, str] | None = None, cwd: str = "/", salt: bytes = SALT) -> str:
    return snapshot_key(argv, "src", env or {}, salt=salt, cwd=cwd)


def test_rotating_an_api_key_in_the_environment_or_the_argv_makes_a_new_key() -> None:
    base = {"VLLM_API_KEY": "old-key", "HF_TOKEN": "hf_old", "PATH": "/usr/bin"}
    assert key(env=base) == key(env=dict(base))
    assert key(env=base) != key(env={**base, "VLLM_API_KEY": "new-key"})  # the revoked key is not restored
    assert key(env=base) != key(env={**base, "HF_TOKEN": "hf_new"})
    assert key(env=base) != key(env={k: v for k, v in base.items() if k != "VLLM_API_KEY"})  # no key any more
    assert key([*ARGV, "--api-key", "a"]) != key([*ARGV, "--api-key", "b"])
    assert key([*ARGV, "--api-key=a"]) != key([*ARGV, "--api-key=b"])
    # any other variable the engine may read changes it too; in doubt a variable is keyed
    assert key(env=base) != key(env={**base, "VLLM_ATTENTION_BACKEND": "X"})
    assert key(env=base) != key(env={**base, "TMPDIR": "/tmp/job2"})  # the restored engine would use the old one


def test_a_run_only_variable_or_a_new_salt_keeps_the_key_and_the_working_folder_does_not() -> None:
    base = {"VLLM_API_KEY": "k", "SLURM_JOB_ID": "1", "OLDPWD": "/a", "SHLVL": "1", "HOSTNAME": "n1", "TERM": "xterm"}
    moved = {**base, "SLURM_JOB_ID": "2", "OLDPWD": "/b", "SHLVL": "3", "HOSTNAME": "n2", "TERM": "dumb",
             "SSH_CONNECTION": "1.2.3.4 5 6.7.8.9 22"}
    assert key(env=base) == key(env=moved)
    assert {"SLURM_JOB_ID", "PWD", "OLDPWD", "SSH_CONNECTION"} <= RUN_ONLY
    assert not {"TMPDIR", "CUDA_VISIBLE_DEVICES", "VLLM_API_KEY", "SLURM_PROCID", "SLURM_LOCALID"} & RUN_ONLY
    assert key(env=base, cwd="/a") != key(env=base, cwd="/b")  # a relative path in the argv means another file
    assert key(env=base, salt=b"t" * 32) != key(env=base)  # the digests are salted


def test_the_content_of_a_file_the_command_names_is_keyed(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("api-key: old\n")
    argv = [*ARGV, "--config", "serve.yaml"]
    before = key(argv, cwd=str(tmp_path))
    config.write_text("api-key: new\n")
    assert key(argv, cwd=str(tmp_path)) != before
    assert key([*ARGV, "--config=serve.yaml"], cwd=str(tmp_path)) != before


def test_the_key_record_holds_no_secret_and_no_value_in_clear(tmp_path: Path) -> None:
    token, api, hidden, plain = (secrets.token_hex(12) for _ in range(4))
    (tmp_path / "c.yaml").write_text(f"api-key: {hidden}\n")
    argv = [*ARGV, "--api-key", api, f"--hf-token={token}", "--config", "c.yaml"]
    env = {"VLLM_API_KEY": api, "HF_TOKEN": token, "REDIS_URL": f"redis://:{hidden}@h:6379", "PLAIN": plain}
    facts = key_facts(argv, "src", env, salt=SALT, cwd=str(tmp_path))
    record = json.dumps(facts)
    for secret in (token, api, hidden, plain):
        assert secret not in record
    assert set(facts["env"]) == set(env) and all(v.startswith("hmac:") for v in facts["env"].values())
    assert facts["argv"][:7] == [*ARGV, "--api-key", facts["argv"][6]] and facts["argv"][6].startswith("hmac:")
    assert facts["argv"][7].startswith("--hf-token=hmac:") and set(facts["files"]) == {"c.yaml"}


def test_the_salt_is_made_once_private_and_a_planted_one_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    salt = key_salt(root)
    assert len(salt) == 32 and key_salt(root) == salt
    assert stat.S_IMODE(os.lstat(root / "key-salt").st_mode) == 0o600
    assert [p.name for p in root.iterdir()] == ["key-salt"]  # no temporary name left
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    (other / "elsewhere").write_bytes(b"x" * 32)
    os.symlink(other / "elsewhere", other / "key-salt")
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP, never the linked file's bytes
        key_salt(other)


# ---- the snapshots folder ----------------------------------------------------------------------------------


def snapshots_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                 events: list) -> EngineSnapshots:
    """EngineSnapshots with CRIU taken as usable (its checks are criu.py's, tested there)."""
    monkeypatch.setattr(engine_snapshots.criu, "why_not", lambda environ: ("criu", ""))
    monkeypatch.setattr(engine_snapshots, "socket_blocker", lambda *a: None)
    monkeypatch.setattr(engine_snapshots, "criu_version", lambda text: (4, 2, 1))
    monkeypatch.setattr(engine_snapshots, "run_quietly", lambda argv: "Version: 4.2.1")
    return EngineSnapshots(True, list(ARGV), "src", tmp_path, tmp_path, lambda e, **f: events.append((e, f)),
                           environ=env)


def test_the_launch_keys_on_its_environment_and_keeps_its_salt_in_a_private_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list = []
    env = {"MXLAUNCH_ENGINE_SNAPSHOTS": str(tmp_path / "snaps"), "VLLM_API_KEY": "old"}
    first = snapshots_on(tmp_path, monkeypatch, env, events)
    again = snapshots_on(tmp_path, monkeypatch, {**env, "OLDPWD": "/elsewhere"}, events)
    rotated = snapshots_on(tmp_path, monkeypatch, {**env, "VLLM_API_KEY": "new"}, events)
    assert events == [] and first.dumpable and first.key == again.key != rotated.key
    root = tmp_path / "snaps" / str(os.getuid())
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700 and (root / "key-salt").is_file()
    assert "old" not in json.dumps(first.facts) and first.facts["env"]["VLLM_API_KEY"].startswith("hmac:")


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A folder in /tmp that the second user can reach (pytest's tmp_path is root's alone)."""
    base = Path(f"/tmp/mxl-test-snaps-{secrets.token_hex(6)}")
    base.mkdir()
    os.chmod(base, 0o1777)  # as /tmp itself
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_a_snapshots_folder_another_user_made_or_can_swap_turns_snapshots_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, intruder: User, shared_base: Path) -> None:
    squatted = shared_base / str(os.getuid())
    intruder.python(f"import os; os.mkdir({str(squatted)!r}, 0o777)")  # made first, by them
    events: list = []
    snaps = snapshots_on(tmp_path, monkeypatch, {"MXLAUNCH_ENGINE_SNAPSHOTS": str(shared_base)}, events)
    [(name, fields)] = events
    assert name == "engine-snapshot" and fields["status"] == "off" and not snaps.dumpable, fields
    assert f"{squatted} belongs to uid {intruder.uid}" in fields["reason"] and " — " in fields["reason"], fields
    assert snaps.try_restore() is None and os.listdir(squatted) == []  # nothing written into theirs
    os.rmdir(squatted)
    os.chown(shared_base, intruder.uid, intruder.gid)
    os.chmod(shared_base, 0o755)
    with pytest.raises(ForeignPath, match=f"{shared_base} .*belongs to uid {intruder.uid}"):
        es.own_root({"MXLAUNCH_ENGINE_SNAPSHOTS": str(shared_base)})  # theirs: they could swap our folder in it
    os.chown(shared_base, 0, 0)
    os.chmod(shared_base, 0o777)
    with pytest.raises(ForeignPath, match="writable by others without the sticky bit"):
        es.safe_ancestors(shared_base)
    os.chmod(shared_base, 0o1777)  # as /tmp: nobody can rename another's folder in it
    es.safe_ancestors(shared_base)


# ---- the post-dump step: /dev/shm names another user made -------------------------------------------------


@pytest.fixture
def shm_names() -> Iterator[list[Path]]:
    """Unique /dev/shm paths for one test, removed after it (whoever made them)."""
    made: list[Path] = []
    yield made
    for path in made:
        try:
            os.unlink(path)
        except OSError:
            pass


def remap_name(made: list[Path]) -> Path:
    path = SHM / f"link_remap.{secrets.randbelow(10**9) + 10**9}"
    made.append(path)
    return path


def holder(path: Path) -> subprocess.Popen:
    """A process that holds `path` open (as the engine holds a POSIX semaphore), started and holding."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); time.sleep(120)", str(path)])
    deadline = time.monotonic() + 30
    while str(path) not in engine_tree.open_files(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, "the holder never opened its file"
        time.sleep(0.01)
    return proc


def test_the_post_dump_step_takes_only_own_held_link_remaps_and_never_blocks(
        tmp_path: Path, intruder: User, shm_names: list[Path]) -> None:
    sem = SHM / f"mxl-test-sem-{secrets.token_hex(6)}"
    shm_names.append(sem)
    sem.write_bytes(b"semaphore")
    engine = holder(sem)
    try:
        ours = remap_name(shm_names)
        os.link(sem, ours)  # what CRIU does: a hard link to the held file, named link_remap.<id>
        sem.unlink()  # the engine's file itself is unlinked (why CRIU links it back)
        unheld = remap_name(shm_names)
        unheld.write_bytes(b"ours, but no file of the engine")
        fifo, planted, link = remap_name(shm_names), remap_name(shm_names), remap_name(shm_names)
        intruder.python(f"""
            import os
            os.mkfifo({str(fifo)!r}, 0o666)
            with open({str(planted)!r}, "w") as f:
                f.write("planted")
            os.symlink({str(ours)!r}, {str(link)!r})
        """)
        folder = tmp_path / "img"
        folder.mkdir(mode=0o700)
        script = snapshot_take._post_dump_script(folder, engine.pid)
        # CRIU runs it while the engine is frozen: a FIFO opened for reading would wait for ever (the deadline fails)
        done = subprocess.run([str(script)], env={"CRTOOLS_SCRIPT_ACTION": "post-dump"}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        keep = folder / "link-remaps"
        assert sorted(os.listdir(keep)) == [ours.name]
        assert (keep / ours.name).read_bytes() == b"semaphore"
        assert stat.S_IMODE(os.stat(keep).st_mode) == 0o700
        assert f"not keeping {unheld}: it is no file the dumped engine holds" in done.stderr
        assert f"not keeping {planted}: it belongs to uid {intruder.uid}" in done.stderr
        for name in (fifo, link):
            assert f"not keeping {name}: it is not a regular file" in done.stderr
        assert planted.read_text() == "planted" and os.lstat(planted).st_uid == intruder.uid  # left alone
    finally:
        engine.kill()
        engine.wait()


COPY_PROBE = """
import json, os, sys
from mxlaunch.warmstart.snapshot_files import copy_held
path, dest, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
st = os.stat(path)  # the name passed the lstat: the descriptor is checked again
try:
    copy_held(path, dest, {(st.st_dev, st.st_ino)}, uid)
    print("copied")
except ValueError as exc:
    print(exc)
"""


def test_the_copy_checks_the_opened_file_again_and_opens_no_fifo_or_link(
        tmp_path: Path, intruder: User, shm_names: list[Path]) -> None:
    fifo, planted, link = remap_name(shm_names), remap_name(shm_names), remap_name(shm_names)
    intruder.python(f"""
        import os
        os.mkfifo({str(fifo)!r}, 0o666)
        open({str(planted)!r}, "w").write("planted")
        os.symlink({str(planted)!r}, {str(link)!r})
    """)

    def copy(path: Path, uid: int) -> str:  # in a child: a blocking open would only fail its deadline
        dest = tmp_path / f"copy-{path.name}"
        done = subprocess.run([sys.executable, "-c", COPY_PROBE, str(path), str(dest), str(uid)], capture_output=True,
                              text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
        assert done.returncode == 0, done.stderr
        return done.stdout.strip() + (" (written)" if dest.exists() else "")

    assert copy(fifo, intruder.uid) == "changed after it was examined"  # a FIFO that passed the lstat by a swap
    assert copy(planted, os.getuid()) == "changed after it was examined"  # another uid's file
    assert copy(link, intruder.uid).startswith("cannot be opened")  # a link: O_NOFOLLOW
    assert copy(planted, intruder.uid) == "copied (written)"  # the same checks pass a file they may pass


def test_a_held_shm_file_another_user_owns_is_not_snapshotted(intruder: User, shm_names: list[Path]) -> None:
    theirs = SHM / f"mxl-test-theirs-{secrets.token_hex(6)}"
    shm_names.append(theirs)
    intruder.python(f"open({str(theirs)!r}, 'w').write('theirs'); import os; os.chmod({str(theirs)!r}, 0o644)")
    engine = holder(theirs)
    try:
        with pytest.raises(es.SnapshotError, match=rf"holds {theirs}, which belongs to uid {intruder.uid}"):
            engine_tree.shm_files([engine.pid])
    finally:
        engine.kill()
        engine.wait()


# ---- the restore: names squatted before it ---------------------------------------------------------------


def fake_snapshot(root: Path, key: str, remaps: list[str], shm_files: list[str]) -> Path:
    """A published snapshot folder with the files a restore puts back (no CRIU image: it stops before CRIU)."""
    folder = root / key
    (folder / "link-remaps").mkdir(parents=True, mode=0o700)
    (folder / "shm-files").mkdir(mode=0o700)
    for name in remaps:
        (folder / "link-remaps" / name).write_bytes(b"kept " + name.encode())
    for path in shm_files:
        (folder / "shm-files" / Path(path).name).write_bytes(b"kept shm")
    meta = {"root": 1, "pids": [], "gpu_pids": [], "pipes": [], "link_remaps": remaps, "shm_files": shm_files}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize("squat", ["link", "file", "fifo"])
def test_a_link_remap_name_squatted_before_the_restore_refuses_it_and_nothing_is_written_through_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, intruder: User, shm_names: list[Path], squat: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's file")
    free, taken = remap_name(shm_names), remap_name(shm_names)
    make = {"link": f"os.symlink({str(victim)!r}, {str(taken)!r})",
            "file": f"open({str(taken)!r}, 'w').write('theirs')",
            "fifo": f"os.mkfifo({str(taken)!r}, 0o666)"}[squat]
    intruder.python(f"import os; {make}")
    events: list = []
    env = {"MXLAUNCH_ENGINE_SNAPSHOTS": str(tmp_path / "snaps")}
    snaps = snapshots_on(tmp_path, monkeypatch, env, events)
    fake_snapshot(es.own_root(env), snaps.key, [free.name, taken.name], [])
    monkeypatch.setattr(snapshot_restore.criu, "restore", lambda *a, **k: pytest.fail("CRIU ran on a squatted name"))

    assert snaps.try_restore() is None  # the launch starts the engine as usual
    [(name, fields)] = events
    assert name == "engine-snapshot" and fields["status"] == "failed", fields
    why = f"belongs to uid {intruder.uid}" if squat == "file" else "is not a regular file"
    assert f"{taken}, which the restore must create, {why}" in fields["reason"], fields
    assert victim.read_text() == "the victim's file"
    assert os.lstat(taken).st_uid == intruder.uid  # theirs, left as it was
    assert not os.path.lexists(free)  # what this restore had already put back is gone again


def test_a_named_shm_file_squatted_before_the_restore_refuses_it(tmp_path: Path, intruder: User,
                                                                 shm_names: list[Path]) -> None:
    name = SHM / f"mxl-test-shm-{secrets.token_hex(6)}"
    shm_names.append(name)
    intruder.python(f"open({str(name)!r}, 'w').write('theirs')")
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    folder = fake_snapshot(root, "k", [], [str(name)])
    with pytest.raises(es.SnapshotError, match=rf"{name}, which the restore must create, belongs to uid {intruder.uid}"):
        snapshot_restore.restore("criu-never-run", folder, tmp_path / "work")
    assert name.read_text() == "theirs"


def test_a_restore_puts_its_files_back_as_new_private_names_and_replaces_only_its_own_leftovers(
        tmp_path: Path, shm_names: list[Path]) -> None:
    left, fresh, named = remap_name(shm_names), remap_name(shm_names), SHM / f"mxl-test-shm-{secrets.token_hex(6)}"
    shm_names.append(named)
    left.write_bytes(b"an earlier failed restore's")
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    folder = fake_snapshot(root, "k", [left.name, fresh.name], [str(named)])
    os.chmod(folder / "link-remaps" / fresh.name, 0o640)
    made = snapshot_restore.put_back(folder, json.loads((folder / "meta.json").read_text()))
    assert [p for p, _, _ in made] == [str(left), str(fresh), str(named)]
    assert left.read_bytes() == b"kept " + left.name.encode() and named.read_bytes() == b"kept shm"
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o640  # as kept
    snapshot_restore.remove_put_back(made)
    assert not [p for p in (left, fresh, named) if os.path.lexists(p)]


def test_removing_what_a_restore_put_back_spares_a_name_another_user_took_since(
        tmp_path: Path, intruder: User, shm_names: list[Path]) -> None:
    name = remap_name(shm_names)
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    folder = fake_snapshot(root, "k", [name.name], [])
    made = snapshot_restore.put_back(folder, json.loads((folder / "meta.json").read_text()))
    name.unlink()  # CRIU consumed it; then another user takes the name
    intruder.python(f"open({str(name)!r}, 'w').write('theirs')")
    snapshot_restore.remove_put_back(made)
    assert name.read_text() == "theirs"
