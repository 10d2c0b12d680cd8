"""mxlaunch doctor: real probes on this machine, JSON shape, Slurm variables, bad paths."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxlaunch import doctor


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mxlaunch.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_o_direct_probe_on_a_real_disk_folder(tmp_path: Path) -> None:
    row = doctor.check_o_direct(tmp_path)
    assert row.status == "ok" and "direct reads work" in row.detail
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_o_direct_refusal_is_a_warning_with_the_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def refuse(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(doctor.os, "open", refuse)
    row = doctor.check_o_direct(tmp_path)
    assert row.status == "warn" and "buffered" in row.fix


def test_json_lists_every_check_with_a_status(tmp_path: Path) -> None:
    result = run_cli("doctor", "--path", str(tmp_path), "--json",
                     env={"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1"})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == 1
    rows = {row["name"]: row for row in data["checks"]}
    assert {row["status"] for row in data["checks"]} <= {"ok", "missing", "warn", "info"}
    assert rows[f"O_DIRECT on {tmp_path}"]["status"] == "ok"
    assert rows["/dev/shm"]["detail"].startswith("tmpfs")
    assert "SLURM_JOB_ID=4242" in rows["Slurm job"]["detail"] and "SLURM_NODEID=1" in rows["Slurm job"]["detail"]
    for name in ("RAM", "CPU cores", "NUMA nodes", "lfs (Lustre)", "NIXL (p2p)", "vLLM", "SGLang"):
        assert name in rows
    for row in data["checks"]:
        if row["status"] in ("missing", "warn"):
            assert row["fix"], row  # every problem says how to fix it


def test_table_output_keeps_extras_visible(tmp_path: Path) -> None:
    result = run_cli("doctor", "--path", str(tmp_path))
    assert result.returncode == 0
    assert "mxlaunch doctor" in result.stdout
    if doctor.check_nixl().status == "missing":
        assert "[p2p]" in result.stdout  # rich markup must not swallow the extra's name


def test_missing_path_is_usage_error() -> None:
    result = run_cli("doctor", "--path", "/definitely/not/here")
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_the_registry_rows_say_an_unauthenticated_redis_is_refused_and_a_wide_peers_folder_is_exposed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MXLAUNCH_REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("MXLAUNCH_REDIS_TRUSTED", raising=False)
    monkeypatch.setenv("MXLAUNCH_REGISTRY", "redis://127.0.0.1:6379/0")
    row = doctor.check_registry(tmp_path)[0]
    assert row.status == "missing" and "refuse" in row.detail and "requirepass" not in row.detail
    monkeypatch.setenv("MXLAUNCH_REDIS_PASSWORD", "pw")
    assert doctor.check_registry(tmp_path)[0].status == "ok"
    monkeypatch.setenv("MXLAUNCH_REGISTRY", "file")
    (tmp_path / ".peers").mkdir()
    os.chmod(tmp_path / ".peers", 0o777)
    row = doctor.check_registry(tmp_path)[0]
    assert row.status == "warn" and "writable by others" in row.detail
    os.chmod(tmp_path / ".peers", 0o700)
    assert doctor.check_registry(tmp_path)[0].status == "ok"
    assert "READ and WRITE" in doctor.check_registry(tmp_path)[1].detail


# `lfs getstripe -d DIR` as Lustre prints a folder's default layout (lfs-getstripe(1)); no Lustre here.
@pytest.mark.parametrize("text, status, says", [
    ("stripe_count:  1 stripe_size:   1048576 pattern:       raid0 stripe_offset: -1\n", "warn", "1 OST"),
    ("stripe_count:  2 stripe_size:   4194304 pattern:       raid0 stripe_offset: -1\n", "warn", "2 OSTs"),
    ("stripe_count:  8 stripe_size:   4194304 pattern:       raid0 stripe_offset: -1\n", "ok", "8 OSTs"),
    ("stripe_count:  -1 stripe_size:   4194304 pattern:       raid0 stripe_offset: -1\n", "ok", "every OST"),
    ("  lcm_layout_gen:    0\n  lcm_mirror_count:  1\n  lcm_entry_count:   3\n    lcme_id:             N/A\n", "info", "PFL"),
])
def test_the_stores_default_striping_is_judged(tmp_path: Path, text: str, status: str, says: str) -> None:
    from mxlaunch.doctor import striping_advice

    row = striping_advice(tmp_path, text)
    assert row.status == status and says in row.detail, row
    if status == "warn":
        assert f"lfs setstripe -c 8 -S 4M {tmp_path}" in row.fix


STATUS = "Name:\tpython3\nCapInh:\t0000000000000000\nCapEff:\t{}\nCapBnd:\t000001ffffffffff\n"


@pytest.mark.parametrize("capeff, caps_ok", [("000001ffffffffff", True),  # root in a privileged container
                                             ("00000000a80425fb", False),  # Docker's default set
                                             ("0000010000000000", True),  # CAP_CHECKPOINT_RESTORE alone
                                             ("0000000000000000", False)])
def test_the_engine_snapshot_row_names_each_missing_half_with_its_fix(capeff: str, caps_ok: bool) -> None:
    from mxlaunch.warmstart import engine_checkpoint as ec
    from mxlaunch.doctor import check_engine_checkpoint

    caps = ec.effective_caps(STATUS.format(capeff))
    assert ec.assess(caps, "/usr/sbin/criu", True).caps_ok is caps_ok
    full = ec.assess(caps, "/usr/sbin/criu", True)
    row = check_engine_checkpoint(full)
    assert (row.status == "ok") is caps_ok
    if not caps_ok:
        assert "CAP_CHECKPOINT_RESTORE" in row.detail and "--cap-add CHECKPOINT_RESTORE" in row.fix
    bare = check_engine_checkpoint(ec.assess(caps, None, False, 12040))
    assert bare.status == "info" and "criu is not on PATH" in bare.detail and "apt install criu" in bare.fix
    assert "driver API 12040" in bare.detail and "driver 570" in bare.fix


def test_a_criu_older_than_4_is_a_blocker_with_the_kit_as_fix() -> None:
    """Debian 12's criu 3.17.1 is on PATH there but fails `criu check` on 6.x kernels; a 4.1.1 build passes."""
    from mxlaunch.warmstart import engine_checkpoint as ec
    from mxlaunch.doctor import check_engine_checkpoint

    assert ec.criu_version("Version: 3.17.1\n") == (3, 17, 1) and ec.criu_version("Version: 4.1.1\nGitID: x") == (4, 1, 1)
    assert ec.criu_version("") is None
    caps = ec.effective_caps(STATUS.format("000001ffffffffff"))
    old = check_engine_checkpoint(ec.assess(caps, "/usr/sbin/criu", True, 13000, (3, 17, 1)))
    assert old.status == "info" and "criu 3.17.1 is older than 4.0" in old.detail
    assert "scripts/kits/build_criu_kit.sh" in old.fix
    assert check_engine_checkpoint(ec.assess(caps, "/usr/sbin/criu", True, 13000, (4, 1, 1))).status == "ok"


def test_the_cuda_checkpoint_api_is_read_from_libcuda_without_a_context() -> None:
    from mxlaunch.warmstart import engine_checkpoint as ec

    class Lib:
        def cuDriverGetVersion(self, out) -> int:  # noqa: N802 — the driver's name
            out._obj.value = 13000
            return 0

    with_api = type("WithApi", (Lib,), {name: staticmethod(lambda *a: 0) for name in ec.CUDA_CHECKPOINT_SYMBOLS})
    assert ec.cuda_checkpoint_api(lambda _: with_api()) == (True, 13000)
    assert ec.cuda_checkpoint_api(lambda _: Lib()) == (False, 13000)

    def no_driver(_: str):
        raise OSError("libcuda.so.1: cannot open shared object file")

    assert ec.cuda_checkpoint_api(no_driver) == (None, None)


def test_the_zygote_image_row_says_whether_a_first_start_can_restore(tmp_path: Path) -> None:
    from mxlaunch.doctor import check_zygote_images
    from mxlaunch.warmstart import criu

    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 4.1.1'\n")
    fake.chmod(0o755)
    row = check_zygote_images(criu.why_not({"MXLAUNCH_CRIU": str(fake)}, STATUS.format("0000010000000000")))
    assert row.status == "ok" and str(fake) in row.detail
    row = check_zygote_images(criu.why_not({"MXLAUNCH_CRIU": str(fake)}, STATUS.format("00000000a80425fb")))
    assert row.status == "info" and "no CAP_CHECKPOINT_RESTORE" in row.detail and "forks restarts only" in row.fix
