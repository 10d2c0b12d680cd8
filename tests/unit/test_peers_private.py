"""Who can read and write the P2P registry: records private from their creation (0600 in 0700 folders, or
0640 in 2770 folders with MXLAUNCH_GROUP), records others could have written or read refused with a reason,
and a Redis registry without a password refused (exit 2) unless the network is declared trusted."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from mxlaunch.coord.peers import local_record, open_registry
from mxlaunch.coord.peers_file import FileRegistry
from mxlaunch.errors import UsageError
from tests.helpers.cli import one_line_error, run_cli

SID = "0123456789abcdef"


def rec(worker: str = "w0"):
    return local_record(SID, 0, 1, layout="raw", worker=worker, run_id="run-a", device="cpu",
                        agent_metadata=b"\x00md", tensors=[{"name": "a", "dtype": "float32", "shape": [2], "bytes": 8,
                                                            "addr": 4096, "dev": 0}])


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def workers(entries) -> list[str]:
    return sorted(e.record.worker for e in entries)


def test_records_and_their_folders_are_private_whatever_the_umask(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MXLAUNCH_GROUP", raising=False)
    old = os.umask(0)  # a umask that would leave every new file world-writable
    try:
        reg = FileRegistry(tmp_path)
        pub = reg.publish(rec())
    finally:
        os.umask(old)
    assert mode(pub.path) == 0o600 and mode(pub.beat_path) == 0o600
    assert [mode(d) for d in (reg.dir, reg.dir / SID, reg.rank_dir(SID, 0))] == [0o700] * 3
    assert workers(reg.sources(SID, 0)) == ["w0"] and reg.refusals == []
    pub.heartbeat()
    assert mode(pub.beat_path) == 0o600
    pub.unpublish()


def test_an_existing_wide_peers_folder_is_narrowed_on_publish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MXLAUNCH_GROUP", raising=False)
    (tmp_path / ".peers").mkdir(mode=0o755)
    os.chmod(tmp_path / ".peers", 0o755)  # what an older mxlaunch left with umask 022
    reg = FileRegistry(tmp_path)
    reg.publish(rec()).unpublish()
    assert mode(reg.dir) == 0o700


def _a_group() -> grp.struct_group:
    mine = os.getgid()
    for g in grp.getgrall():
        if g.gr_gid != mine:
            return g
    pytest.skip("this host has no second group")


def test_with_a_shared_group_records_are_0640_in_2770_folders_of_that_group(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    group = _a_group()
    if os.getuid() != 0 and os.getuid() not in [p for p in group.gr_mem]:
        pytest.skip("needs a group this user may give files")
    monkeypatch.setenv("MXLAUNCH_GROUP", group.gr_name)
    reg = FileRegistry(tmp_path)
    pub = reg.publish(rec())
    assert mode(pub.path) == 0o640 and os.lstat(pub.path).st_gid == group.gr_gid
    assert mode(reg.rank_dir(SID, 0)) == 0o2770 and os.lstat(reg.rank_dir(SID, 0)).st_gid == group.gr_gid
    assert workers(reg.sources(SID, 0)) == ["w0"]
    monkeypatch.delenv("MXLAUNCH_GROUP")  # the same record read by a user who shares no group: refused
    assert reg.sources(SID, 0) == [] and "open to group" in reg.refusals[0]
    pub.unpublish()


@pytest.mark.parametrize("how, words", [
    (lambda p: os.chmod(p, 0o644), "readable or writable by others (mode 0644)"),
    (lambda p: os.chmod(p, 0o606), "readable or writable by others (mode 0606)"),
    (lambda p: os.chmod(p, 0o640), "is open to group"),
    (lambda p: os.chown(p, 65534, -1), "belongs to uid 65534"),
    (lambda p: os.chmod(p.parent, 0o777), "writable by others (mode 0777)"),
    (lambda p: os.chmod(p.parent.parent.parent, 0o773), "writable by others (mode 0773)"),
])
def test_a_record_others_could_have_written_or_read_is_refused_with_a_reason(tmp_path: Path, how, words: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MXLAUNCH_GROUP", raising=False)
    if "uid" in words and os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    reg = FileRegistry(tmp_path, host="node-b")
    pub = reg.publish(rec())
    assert workers(reg.sources(SID, 0)) == ["w0"]
    how(pub.path)
    assert reg.sources(SID, 0) == [] and reg.all_sources() == []
    assert len(reg.refusals) == 1 and words in reg.refusals[0] and " — " in reg.refusals[0], reg.refusals
    os.chmod(pub.path.parent, 0o700)
    os.chmod(reg.dir, 0o700)


# ---- Redis ------------------------------------------------------------------------------------------------


def test_a_redis_url_without_a_password_is_refused_before_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MXLAUNCH_REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("MXLAUNCH_REDIS_TRUSTED", raising=False)
    with pytest.raises(UsageError) as info:
        open_registry("redis://127.0.0.1:1/0", None)
    line = info.value.one_line()
    assert info.value.exit_code == 2 and "has no password" in line and "MXLAUNCH_REDIS_TRUSTED=1" in line
    monkeypatch.setenv("MXLAUNCH_REDIS_TRUSTED", "yes")  # only 1 counts
    with pytest.raises(UsageError, match="has no password"):
        open_registry("redis://127.0.0.1:1/0", None)
    monkeypatch.setenv("MXLAUNCH_REDIS_TRUSTED", "1")  # now it tries to connect (and nothing listens on port 1)
    with pytest.raises(UsageError, match="cannot reach the peer registry"):
        open_registry("redis://127.0.0.1:1/0", None)


def test_peers_refuses_an_unauthenticated_redis_url_in_one_line_exit_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXLAUNCH_REDIS")}
    result = run_cli("peers", "--artifact-path", str(tmp_path), "--registry", "redis://127.0.0.1:1/0", env=env)
    assert result.returncode == 2
    line = one_line_error(result)
    assert "has no password" in line and "—" in line


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.hostname}:{parts.port}"))


@pytest.mark.redis
def test_the_password_may_come_from_the_environment_and_a_wrong_one_is_refused(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MXLAUNCH_REDIS_TRUSTED", raising=False)
    bare = _without_password(redis_url)
    monkeypatch.setenv("MXLAUNCH_REDIS_PASSWORD", urlsplit(redis_url).password)
    reg = open_registry(bare, None)
    pub = reg.publish(rec("env-pw"))
    assert workers(reg.sources(SID, 0)) == ["env-pw"]
    pub.unpublish()
    monkeypatch.setenv("MXLAUNCH_REDIS_PASSWORD", "wrong")
    with pytest.raises(UsageError, match="refused our login"):
        open_registry(bare, None)
    monkeypatch.delenv("MXLAUNCH_REDIS_PASSWORD")
    monkeypatch.setenv("MXLAUNCH_REDIS_TRUSTED", "1")  # trusted but the server wants a password: it says so
    with pytest.raises(UsageError, match="refused our login"):
        open_registry(bare, None)
