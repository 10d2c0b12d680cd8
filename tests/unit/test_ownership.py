"""The one opener for names someone else may have planted (safety/ownership.py open_judged), on its own: its callers'
rules (open_own, trust.open_trusted, logfile.open_log) are tested where they are used (test_shared_shm,
test_code_trust, test_launch_secrets); here what every one of them relies on."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from mxlaunch.safety.ownership import ForeignPath, open_judged, open_own

pytestmark = pytest.mark.unit


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_refused_descriptor_is_closed_and_an_accepted_one_blocks_again(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("x")
    before = _open_fds()
    assert open_judged(path, os.O_RDONLY, lambda st: "is not wanted") == (None, "is not wanted")
    assert _open_fds() == before  # nothing left open by a refusal
    fd, why = open_judged(path, os.O_RDONLY, lambda st: None)
    try:
        assert why == "" and os.get_blocking(fd)
        assert os.read(fd, 1) == b"x"
    finally:
        os.close(fd)


def test_a_fifo_is_judged_without_blocking_and_a_link_is_never_followed(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes it: a blocking open for reading would hang here
    seen: list[int] = []

    def regular_only(st: os.stat_result) -> str | None:
        seen.append(st.st_mode)
        return None if stat.S_ISREG(st.st_mode) else "is not a regular file"

    assert open_judged(fifo, os.O_RDONLY, regular_only) == (None, "is not a regular file")
    assert stat.S_ISFIFO(seen[-1])  # judged on the descriptor it opened
    target = tmp_path / "target"
    target.write_text("mine")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError) as exc:
        open_judged(tmp_path / "link", os.O_RDONLY, lambda st: None)
    assert exc.value.errno == errno.ELOOP
    with pytest.raises(ForeignPath, match="is not a regular file"):  # open_own: the same opener, foreign()'s rule
        open_own(fifo)
