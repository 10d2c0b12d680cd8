"""The engine snapshot's key: everything a restored engine shares with the command that asked for it.

Why the whole environment: a restored engine is the old process, its environment frozen in the image. A
variable the key ignored would be silently ignored by the restore too — rotating `VLLM_API_KEY` restored the
old server, which still accepted the revoked key and refused the new one (issue 41). So every variable is in
the key except a short list that only describes the run or the shell (RUN_ONLY: job ids, the terminal, the
session), whose old value cannot change what the engine serves; when in doubt a variable is keyed (a miss
costs one normal start, a wrong hit serves the wrong engine). Files the command names (a `--config` YAML, a
chat template) are keyed by their content.

Secrets never appear in clear: every variable's value, the value of a secret flag (`--api-key`, `--hf-token`,
any flag whose name says key, token, secret, password, credential) and every named file's content enter as
HMAC-SHA256 digests under a random per-user salt kept in the private snapshots folder (`key-salt`, 0600): the
record written beside a snapshot (`key.json`) says which variable differs between two snapshots, not its
value, and a digest of a short key cannot be tried against the record by a reader without the salt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from mxlaunch.safety.ownership import create_own, open_own

RECORD = "key.json"
SALT = "key-salt"
SALT_BYTES = 32
MAX_FILE_BYTES = 16 << 20  # a named file larger than this is keyed by size and mtime, not read
# Variables that describe the run or the shell, not the engine: a restored engine keeps its old values, harmlessly.
# (The working directory is keyed itself, as `cwd`; TMPDIR is keyed: a restored engine would write into the old
# job's temporary folder, maybe gone or, in a shared /tmp, someone else's by then.)
RUN_ONLY = frozenset((
    # Slurm: which job and step this is, where it was submitted from, the step's ports
    "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_TASK_PID", "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID", "SLURM_HET_JOB_ID", "SLURM_JOB_START_TIME", "SLURM_JOB_END_TIME", "SLURM_SUBMIT_DIR",
    "SLURM_SUBMIT_HOST", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_SRUN_COMM_HOST", "SLURM_SRUN_COMM_PORT",
    "SLURM_STEP_LAUNCHER_PORT", "SLURM_STEP_RESV_PORTS", "SLURM_RESTART_COUNT", "SLURM_JOB_NAME",
    # the shell and the terminal
    "PWD", "OLDPWD", "SHLVL", "_", "TERM", "COLORTERM", "COLUMNS", "LINES", "TERM_PROGRAM", "TERM_PROGRAM_VERSION",
    "TERM_SESSION_ID", "LS_COLORS", "PS1", "PS2", "PROMPT_COMMAND", "HISTFILE", "HISTSIZE", "HISTFILESIZE",
    "HISTCONTROL", "MAIL", "LESSOPEN", "LESSCLOSE", "HOSTNAME",
    # the login session
    "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK", "SSH_AGENT_PID", "DISPLAY", "WINDOWID",
    "XAUTHORITY", "GPG_TTY", "TMUX", "TMUX_PANE", "STY", "WINDOW", "XDG_SESSION_ID", "XDG_SESSION_TYPE",
    "XDG_SESSION_CLASS", "XDG_VTNR", "DBUS_SESSION_BUS_ADDRESS", "INVOCATION_ID", "JOURNAL_STREAM",
    "SYSTEMD_EXEC_PID", "MANAGERPID",
    # a test runner's per-test name
    "PYTEST_CURRENT_TEST",
))
SECRET_FLAG = re.compile(r"KEY|TOKEN|SECRET|PASSW|PASSPHRASE|CREDENTIAL|AUTH|COOKIE", re.I)


def key_salt(root: Path) -> bytes:
    """This user's salt for the key's digests: `root/key-salt`, made once (random, 0600, published by link so
    that racing launches agree). `root` is the private snapshots folder (engine_snapshot.own_root)."""
    path = root / SALT
    try:
        fd = open_own(path)
    except FileNotFoundError:
        tmp = root / f".{SALT}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        out = create_own(tmp)
        try:
            os.write(out, secrets.token_bytes(SALT_BYTES))
        finally:
            os.close(out)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another launch made it first: use theirs
        finally:
            tmp.unlink()
        fd = open_own(path)
    with os.fdopen(fd, "rb") as fh:
        salt = fh.read(SALT_BYTES + 1)
    if len(salt) != SALT_BYTES:
        raise ValueError(f"{path} holds {len(salt)} bytes, not {SALT_BYTES}: remove it (the next launch makes a new one)")
    return salt


def digest(salt: bytes, value: bytes) -> str:
    return "hmac:" + hmac.new(salt, value, hashlib.sha256).hexdigest()[:32]


def secret_flag(token: str) -> bool:
    """Is `token` a flag whose value is a secret (--api-key, --hf-token, --admin-api-key, ...)?"""
    return token.startswith("-") and bool(SECRET_FLAG.search(token.split("=", 1)[0]))


def argv_facts(argv: Sequence[str], salt: bytes) -> list[str]:
    """The argv with the values of secret flags as digests (`--api-key=V` and `--api-key V` alike)."""
    out, hide_next = [], False
    for token in map(str, argv):
        if hide_next and not token.startswith("-"):
            out.append(digest(salt, token.encode()))
        elif secret_flag(token) and "=" in token:
            flag, value = token.split("=", 1)
            out.append(f"{flag}={digest(salt, value.encode())}")
        else:
            out.append(token)
        hide_next = secret_flag(token) and "=" not in token
    return out


def file_facts(argv: Sequence[str], salt: bytes, cwd: str) -> dict[str, str]:
    """The regular files the command names (relative to `cwd`), by a digest of their content (a secret flag's
    value is not looked at: its digest is in the argv already)."""
    out: dict[str, str] = {}
    after_secret = False
    for token in map(str, argv[1:]):
        skip = secret_flag(token) or (after_secret and not token.startswith("-"))
        after_secret = secret_flag(token) and "=" not in token
        value = token.split("=", 1)[1] if token.startswith("-") and "=" in token else token
        if skip or not value or value.startswith("-"):  # a secret's value is no file name to write down
            continue
        path = os.path.join(cwd, value)
        try:
            if not os.path.isfile(path):
                continue
            st = os.stat(path)
            if st.st_size > MAX_FILE_BYTES:
                out[value] = digest(salt, f"size={st.st_size} mtime_ns={st.st_mtime_ns}".encode())
                continue
            with open(path, "rb") as fh:
                out[value] = digest(salt, fh.read(MAX_FILE_BYTES + 1))
        except OSError:
            continue
    return out


def key_facts(argv: Sequence[str], source_id: str, environ: Mapping[str, str], salt: bytes = b"",
              cwd: Optional[str] = None) -> dict[str, Any]:
    """What the key digests, as written to key.json: no secret and no variable's value in clear."""
    cwd = os.getcwd() if cwd is None else cwd
    env = {k: digest(salt, v.encode()) for k, v in sorted(environ.items()) if k not in RUN_ONLY}
    return {"argv": argv_facts(argv, salt), "files": file_facts(argv, salt, cwd), "source_id": source_id,
            "python": sys.executable, "kernel": os.uname().release, "cwd": cwd, "env": env}


def key_of(facts: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def snapshot_key(argv: Sequence[str], source_id: str, environ: Mapping[str, str] = os.environ, salt: bytes = b"",
                 cwd: Optional[str] = None) -> str:
    """The key of key_facts (the launcher passes this user's salt; tests may leave it empty)."""
    return key_of(key_facts(argv, source_id, environ, salt, cwd))
