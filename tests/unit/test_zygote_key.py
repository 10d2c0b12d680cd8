"""The zygote key travels to a new job (issue 42): it holds only what the zygote's imports read, so a new
Slurm job, node name, host name or TMPDIR finds the same zygote (and its image in the store), while a variable
the engine reads at import, or the interpreter, version, entry or folder, makes another key."""

from __future__ import annotations

import sys
from pathlib import Path

from mxlaunch.warmstart import zygote, zygote_env, zygote_image
from mxlaunch.plan import PLAN_ENV
from mxlaunch.store import zygote_images

ENTRY = zygote.ZygoteEntry(sys.executable, "module", "vllm.entrypoints.openai.api_server", ("--port", "1"), ("torch",))
JOB_A = {"PATH": "/usr/bin", "HOME": "/home/u", "VLLM_LOGGING_LEVEL": "INFO", "HF_HOME": "/hf",
         "SLURM_JOB_ID": "1001", "SLURM_JOBID": "1001", "SLURM_NODELIST": "gpu[01-02]", "SLURMD_NODENAME": "gpu01",
         "SLURM_STEP_ID": "0", "HOSTNAME": "gpu01", "TMPDIR": "/tmp/job.1001", "TMP": "/tmp/job.1001",
         "SSH_CONNECTION": "10.0.0.1 5 10.0.0.2 22", "PWD": "/w", "OLDPWD": "/", "SHLVL": "2", "_": "/usr/bin/mx"}
JOB_B = {**JOB_A, "SLURM_JOB_ID": "2002", "SLURM_JOBID": "2002", "SLURM_NODELIST": "gpu[07-08]",
         "SLURMD_NODENAME": "gpu07", "SLURM_STEP_ID": "3", "HOSTNAME": "gpu07", "TMPDIR": "/tmp/job.2002",
         "TMP": "/tmp/job.2002", "SSH_CONNECTION": "10.0.0.9 7 10.0.0.8 22", "SHLVL": "4", "_": "/bin/env",
         PLAN_ENV: "/dev/shm/x/plan.json", "SOME_TOOL_SETTING": "x"}


def key(env: dict, **kw) -> str:
    return zygote.zygote_key(kw.pop("entry", ENTRY), kw.pop("version", "0.26.0"), env, kw.pop("cwd", "/w"),
                             salt=kw.pop("salt", b"s" * 32))


def test_a_new_job_node_host_and_tmpdir_keep_the_key() -> None:
    assert key(JOB_A) == key(JOB_B)


def test_what_the_imports_read_interpreter_version_entry_and_folder_change_it() -> None:
    base = key(JOB_A)
    others = [key({**JOB_A, "VLLM_LOGGING_LEVEL": "DEBUG"}), key({**JOB_A, "HF_HOME": "/other"}),
              key({**JOB_A, "TORCHINDUCTOR_CACHE_DIR": "/c"}), key({**JOB_A, "LD_LIBRARY_PATH": "/x"}),
              key({**JOB_A, "PYTHONPATH": "/p"}), key({**JOB_A, "CUDA_VISIBLE_DEVICES": "1"}),
              key({**JOB_A, "HOME": "/home/v"}), key(JOB_A, version="0.27.0"), key(JOB_A, cwd="/v"),
              key(JOB_A, entry=zygote.ZygoteEntry("/other/python", "module", ENTRY.target, (), ENTRY.preload))]
    assert base not in others and len(set(others)) == len(others)


def test_values_enter_as_salted_digests() -> None:
    """A token read at import (huggingface_hub keeps OAUTH_CLIENT_SECRET) is keyed by its digest under the
    user's salt: another salt makes another key from the same environment."""
    env = {**JOB_A, "OAUTH_CLIENT_SECRET": "hunter2"}
    assert key(env) != key(env, salt=b"t" * 32)
    assert key(env) != key({**env, "OAUTH_CLIENT_SECRET": "hunter3"})


def test_the_salt_lives_beside_the_images_and_is_stable(tmp_path: Path) -> None:
    salt = zygote_image.key_salt(tmp_path / "store")
    assert len(salt) == 32 and salt == zygote_image.key_salt(tmp_path / "store")
    assert (zygote_image.images_root(tmp_path / "store") / "key-salt").stat().st_mode & 0o077 == 0
    assert zygote_images.list_images(tmp_path / "store") == []  # the salt file is no image


def test_run_only_names_are_not_keyed_and_pinned_ones_are_not_either() -> None:
    for name in ("SLURM_JOB_ID", "SLURM_NODELIST", "SLURMD_NODENAME", "HOSTNAME", "SSH_CONNECTION", "PWD", "_",
                 *zygote_env.PINNED):
        assert not zygote_env.keyed(name), name
