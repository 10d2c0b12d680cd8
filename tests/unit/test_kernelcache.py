"""JIT kernel caches on real tar files and a real store: member checks, the key, restore/capture, races."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import sys
import tarfile
from pathlib import Path

import pytest

from mxlaunch.coord.file import FileCoordinator
from mxlaunch.engines.vllm_argv import parse_vllm_argv
from mxlaunch.kernelcache.caches import cache_key, cache_vars, cpu_isa, folder_state, key_fields
from mxlaunch.kernelcache.archive import KEY_JSON, KernelCacheStore
from mxlaunch.kernelcache.tarball import ArchiveRefused, check_members, extract
from mxlaunch.launch.kernel import plan_kernel_cache

from tests.helpers.cli import run_cli

pytestmark = pytest.mark.unit
PY = sys.executable
VERSIONS = {"torch": "2.13.0+cpu", "triton": "3.9.0", "cuda": None, "python": "3.11.7"}
ACCEL = {"device": "cpu", "machine": "x86_64", "isa": ["avx2", "avx512f"]}
CAP = 1 << 20


def kc(root: Path) -> KernelCacheStore:
    return KernelCacheStore(root, FileCoordinator(root))


def fields_for(*extra: str, version: str = "0.32.0", source_id: str = "a" * 16, environ: dict | None = None) -> dict:
    argv = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", *extra]
    spec = parse_vllm_argv(argv, engine_version=version)
    return key_fields(spec, source_id=source_id, device_type="cpu", argv=argv, versions=VERSIONS, accel=ACCEL,
                      environ=environ or {})


def make_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def reg(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def special(name: str, kind: bytes, target: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def cache_tree(root: Path) -> Path:
    (root / "vllm" / "torch_compile_cache" / "abc" / "rank_0_0").mkdir(parents=True)
    (root / "vllm" / "torch_compile_cache" / "abc" / "rank_0_0" / "model").write_bytes(b"graph" * 100)
    (root / "inductor" / "fx").mkdir(parents=True)
    (root / "inductor" / "fx" / "kernel.so").write_bytes(os.urandom(4096))
    os.chmod(root / "inductor" / "fx" / "kernel.so", 0o755)
    (root / "triton").mkdir()
    (root / "triton" / "empty.lock").write_bytes(b"")
    (root / "triton" / "link").symlink_to("/etc/passwd")  # never archived
    return root


# ---- member checks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("member, needle", [
    (reg("/etc/evil"), "absolute"),
    (reg("a/../../evil"), "'..'"),
    (special("a/link", tarfile.SYMTYPE, "/etc/passwd"), "a link"),
    (special("a/hard", tarfile.LNKTYPE, "a/ok"), "a link"),
    (special("a/fifo", tarfile.FIFOTYPE), "not a regular file"),
    (special("a/dev", tarfile.CHRTYPE), "not a regular file"),
    (reg("big", b"y" * (CAP + 1)), "cap"),
])
def test_bad_members_are_refused_before_anything_is_written(tmp_path: Path, member: tuple, needle: str) -> None:
    archive = make_tar(tmp_path / "a.tar", [reg("a/ok", b"fine"), member])  # the good member comes first
    with tarfile.open(archive) as tar, pytest.raises(ArchiveRefused) as err:
        check_members(tar, CAP)
    assert needle in str(err.value)
    with pytest.raises(ArchiveRefused):
        extract(archive, tmp_path / "dest", CAP)
    assert not (tmp_path / "dest" / "a" / "ok").exists()  # nothing written: the checks ran first


def test_extract_does_not_follow_a_link_already_in_the_destination(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "triton").symlink_to(outside)
    archive = make_tar(tmp_path / "a.tar", [reg("triton/x", b"data")])
    with pytest.raises(ArchiveRefused, match="leads out"):
        extract(archive, dest, CAP)
    assert list(outside.iterdir()) == []


# ---- the key ----------------------------------------------------------------------------------------------


def test_key_is_stable_and_ignores_what_does_not_change_compiled_code() -> None:
    base = cache_key(fields_for("--dtype", "float32"))
    assert base == cache_key(fields_for("--dtype", "float32"))
    assert len(base) == 24 and base.isalnum()
    assert base == cache_key(fields_for("--dtype", "float32", "--port", "9000", "--served-model-name", "x"))


@pytest.mark.parametrize("change", [
    {"extra": ("--dtype", "bfloat16")},
    {"extra": ("--dtype", "float32", "--max-num-batched-tokens", "512")},
    {"extra": ("--dtype", "float32", "--enforce-eager")},
    {"extra": ("--dtype", "float32", "-O", "0")},
    {"extra": ("--dtype", "float32", "--compilation-config", '{"mode": 0}')},
    {"extra": ("--dtype", "float32"), "version": "0.33.0"},
    {"extra": ("--dtype", "float32"), "source_id": "b" * 16},
])
def test_key_changes_with_what_changes_compiled_code(change: dict) -> None:
    base = cache_key(fields_for("--dtype", "float32"))
    assert cache_key(fields_for(*change["extra"], **{k: v for k, v in change.items() if k != "extra"})) != base


def test_key_follows_the_variables_vllms_own_compile_cache_hashes() -> None:
    """Two starts that differ only in a variable vLLM hashes get different keys (an archive restored across them
    would be one vLLM ignores and rebuilds); one that vLLM ignores (its port, logging, start method: mxlaunch's
    engine fork sets that one) keeps the key."""
    base = cache_key(fields_for(environ={"PATH": "/bin"}))
    assert cache_key(fields_for(environ={"VLLM_USE_FLASHINFER_SAMPLER": "0"})) != base
    assert cache_key(fields_for(environ={"VLLM_USE_FLASHINFER_SAMPLER": "1"})) != cache_key(
        fields_for(environ={"VLLM_USE_FLASHINFER_SAMPLER": "0"}))
    for ignored in ("VLLM_PORT", "VLLM_LOGGING_LEVEL", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_CACHE_ROOT", "VLLM_HOST_IP"):
        assert cache_key(fields_for(environ={ignored: "x", "HOME": "/h"})) == base, ignored
    assert fields_for(environ={"VLLM_USE_DEEP_GEMM": "1", "VLLM_PORT": "1"})["env"] == {"VLLM_USE_DEEP_GEMM": "1"}
    # the fields are written beside the archive: no secret's value goes there
    assert "VLLM_API_KEY" not in fields_for(environ={"VLLM_API_KEY": "s3cr3t"})["env"]
    shown = json.dumps(fields_for(environ={"VLLM_SOME_TOKEN": "s3cr3t"}))
    assert "s3cr3t" not in shown and "VLLM_SOME_TOKEN" in shown


def test_the_ignored_variables_are_the_ones_the_installed_vllm_ignores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle: vLLM's own `envs.compile_factors()` — each variable our key leaves out must leave vLLM's factors
    unchanged when set, and one our key takes must change them."""
    import vllm.envs as envs  # noqa: PLC0415
    from mxlaunch.engines.vllm_compile_key import COMPILE_ENV_IGNORED, compile_env  # noqa: PLC0415

    known = set(envs.environment_variables)
    base = envs.compile_factors()
    for name in sorted(COMPILE_ENV_IGNORED & known):
        monkeypatch.setenv(name, "1")
        assert envs.compile_factors() == base, f"vLLM hashes {name}, which the kernel cache key leaves out"
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    assert envs.compile_factors() != base
    # Both ways, through the key's own function: a VLLM_* variable set in the engine's environment enters the
    # key exactly when vLLM's factors hash it (a factor is a variable vLLM read; its value is whatever it read).
    vllm_names = sorted(n for n in known if n.startswith("VLLM_"))
    taken = {n for n in vllm_names if n in compile_env({n: "1"})}
    assert taken == {n for n in base if n.startswith("VLLM_")} and len(taken) > 100


def test_flashinfer_builds_move_into_the_key_folder_and_its_downloaded_cubins_stay(tmp_path: Path) -> None:
    """vLLM's default sampler on CUDA is FlashInfer's, JIT-built under $FLASHINFER_WORKSPACE_BASE (~117 s on a
    fresh H200 node): the key's folder holds it. The cubins FlashInfer downloads live under the same base; they
    keep their default place."""
    from mxlaunch.engines.vllm_engine import ENGINE  # noqa: PLC0415

    cv = cache_vars(ENGINE.kernel_cache_vars, tmp_path, {"HOME": "/home/u"})
    assert cv.env["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "flashinfer")
    assert cv.env["FLASHINFER_CUBIN_DIR"] == "/home/u/.cache/flashinfer/cubins"
    assert {"TVM_FFI_CACHE_DIR", "CUDA_CACHE_PATH"} <= set(cv.env)
    mine = cache_vars(ENGINE.kernel_cache_vars, tmp_path, {"HOME": "/home/u", "FLASHINFER_CUBIN_DIR": "/cubins"})
    assert "FLASHINFER_CUBIN_DIR" not in mine.env and "FLASHINFER_CUBIN_DIR" not in mine.unmanaged
    theirs = cache_vars(ENGINE.kernel_cache_vars, tmp_path, {"HOME": "/home/u", "FLASHINFER_WORKSPACE_BASE": "/fi"})
    assert "FLASHINFER_CUBIN_DIR" not in theirs.env and "FLASHINFER_WORKSPACE_BASE" in theirs.unmanaged


def test_key_changes_with_versions_and_accelerator() -> None:
    f = fields_for()
    assert cache_key({**f, "versions": {**VERSIONS, "torch": "2.14.0"}}) != cache_key(f)
    assert cache_key({**f, "accelerator": {**ACCEL, "isa": ["avx2"]}}) != cache_key(f)


def test_cpu_isa_reads_x86_and_arm_cpuinfo() -> None:
    assert cpu_isa("processor: 0\nflags\t: fpu avx2 smep sse4_2 avx512f amx_tile\n") == ["amx_tile", "avx2", "avx512f", "sse4_2"]
    assert cpu_isa("Features\t: fp asimd sve i8mm sme\n") == ["asimd", "i8mm", "sme", "sve"]


def test_user_set_variables_are_left_alone(tmp_path: Path) -> None:
    cv = cache_vars((("VLLM_CACHE_ROOT", "vllm"), ("TRITON_CACHE_DIR", "triton")), tmp_path, {"TRITON_CACHE_DIR": "/mine"})
    assert cv.env == {"VLLM_CACHE_ROOT": str(tmp_path / "vllm")} and cv.unmanaged == ["TRITON_CACHE_DIR"]


# ---- restore / capture ------------------------------------------------------------------------------------


def test_capture_then_restore_round_trips_into_a_fresh_folder(tmp_path: Path) -> None:
    src = cache_tree(tmp_path / "node1")
    store = kc(tmp_path / "store")
    fields = fields_for()
    key = cache_key(fields)
    assert store.restore(key, tmp_path / "x", CAP).status == "miss"
    captured = store.capture(key, fields, src, CAP, model="/models/tiny")
    assert captured.published, captured.reason
    assert captured.files == 3
    restored = store.restore(key, tmp_path / "node2", CAP)
    assert restored.status == "hit" and restored.files == 3, restored.reason
    want = {p: v[0] for p, v in folder_state(src).items()}
    assert {p: v[0] for p, v in folder_state(tmp_path / "node2").items()} == want
    assert (tmp_path / "node2" / "inductor" / "fx" / "kernel.so").read_bytes() == (src / "inductor" / "fx" / "kernel.so").read_bytes()
    assert os.access(tmp_path / "node2" / "inductor" / "fx" / "kernel.so", os.X_OK)
    assert not (tmp_path / "node2" / "triton" / "link").exists()
    # a second capture replaces the archive atomically: one archive, key.json names it
    (src / "triton" / "new.bin").write_bytes(b"n")
    assert store.capture(key, fields, src, CAP, model="/models/tiny").published
    tars = sorted(p.name for p in (tmp_path / "store" / "kernel-cache" / key).glob("cache-*.tar"))
    meta = json.loads((tmp_path / "store" / "kernel-cache" / key / KEY_JSON).read_text())
    assert tars == [meta["archive"]] and meta["files"] == 4 and meta["model"] == "/models/tiny"
    assert [e.key for e in store.list()] == [key]


def test_a_cache_is_never_stored_or_restored_under_another_key(tmp_path: Path) -> None:
    src = cache_tree(tmp_path / "node1")
    store = kc(tmp_path / "store")
    fields = fields_for()
    key = cache_key(fields)
    other = cache_key(fields_for("--dtype", "bfloat16"))
    assert not store.capture(other, fields, src, CAP).published  # fields of one key, folder of another: refused
    assert store.capture(key, fields, src, CAP).published
    # someone copies the archive under the bfloat16 key: refused (key.json's key and fields)
    import shutil

    shutil.copytree(tmp_path / "store" / "kernel-cache" / key, tmp_path / "store" / "kernel-cache" / other)
    result = store.restore(other, tmp_path / "n2", CAP)
    assert result.status == "miss" and "never restored under another key" in result.reason
    # a key.json rewritten to claim the other key, with a newer engine version in its fields
    meta_path = tmp_path / "store" / "kernel-cache" / other / KEY_JSON
    meta = json.loads(meta_path.read_text())
    meta["key"] = other
    meta["fields"]["engine_version"] = "0.33.0"
    meta_path.write_text(json.dumps(meta))
    result = store.restore(other, tmp_path / "n3", CAP)
    assert result.status == "miss" and "do not hash to its key" in result.reason
    assert not (tmp_path / "n2").exists() and not (tmp_path / "n3").exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing", "bad-json"])
def test_a_damaged_archive_is_a_miss_with_one_line(tmp_path: Path, damage: str) -> None:
    src = cache_tree(tmp_path / "node1")
    (src / "inductor" / "big.bin").write_bytes(os.urandom(200_000))
    store = kc(tmp_path / "store")
    fields = fields_for()
    key = cache_key(fields)
    assert store.capture(key, fields, src, CAP).published
    folder = tmp_path / "store" / "kernel-cache" / key
    meta = json.loads((folder / KEY_JSON).read_text())
    archive = folder / meta["archive"]
    if damage == "truncate":  # cut in the middle of a member, with key.json's size made to agree
        data = archive.read_bytes()[:100_000]
        archive.write_bytes(data)
        meta["archive_bytes"] = len(data)
        (folder / KEY_JSON).write_text(json.dumps(meta))
    elif damage == "garbage":
        archive.write_bytes(b"\x00garbage" * 100)
        meta["archive_bytes"] = 800
        (folder / KEY_JSON).write_text(json.dumps(meta))
    elif damage == "missing":
        archive.unlink()
    else:
        (folder / KEY_JSON).write_text("{not json")
    result = store.restore(key, tmp_path / "node2", CAP)
    assert result.status == "miss"
    assert result.reason and "\n" not in result.reason and key in result.reason


def test_oversized_caches_are_not_captured(tmp_path: Path) -> None:
    src = cache_tree(tmp_path / "node1")
    store = kc(tmp_path / "store")
    fields = fields_for()
    result = store.capture(cache_key(fields), fields, src, 1000)
    assert not result.published and "cap" in result.reason and "MXLAUNCH_KERNEL_CACHE_MAX_GIB" in result.reason
    assert list((tmp_path / "store" / "kernel-cache" / cache_key(fields)).iterdir()) == []  # no temp left


def _race(root: str, src: str, out: str) -> None:
    fields = fields_for()
    result = kc(Path(root)).capture(cache_key(fields), fields, Path(src), CAP)
    Path(out).write_text(json.dumps({"published": result.published, "reason": result.reason}))


def test_concurrent_writers_of_one_key_publish_one_whole_archive(tmp_path: Path) -> None:
    src = cache_tree(tmp_path / "node1")
    for i in range(30):
        (src / "inductor" / f"k{i}.bin").write_bytes(os.urandom(20_000))
    root = tmp_path / "store"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_race, args=(str(root), str(src), str(tmp_path / f"r{i}.json"))) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    results = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(4)]
    assert any(r["published"] for r in results)
    assert all(r["published"] or "another launch" in r["reason"] for r in results), results
    key = cache_key(fields_for())
    folder = root / "kernel-cache" / key
    assert len(list(folder.glob("cache-*.tar"))) == 1 and list(folder.glob(".tmp-*")) == []
    restored = kc(root).restore(key, tmp_path / "node2", CAP)
    assert restored.status == "hit" and restored.files == 33


# ---- plan and CLI -----------------------------------------------------------------------------------------


def test_plan_says_off_miss_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MXLAUNCH_KERNEL_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/users/own")
    argv = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    spec = parse_vllm_argv(argv, engine_version="0.32.0")
    store = kc(tmp_path / "store")
    assert plan_kernel_cache(spec, source_id="a" * 16, device_type="cpu", kc_store=store, enabled=False)["status"] == "off"
    info = plan_kernel_cache(spec, source_id="a" * 16, device_type="cpu", kc_store=store)
    assert info["status"] == "miss" and info["dir"] == str(tmp_path / "local" / info["key"])
    assert info["env"]["VLLM_CACHE_ROOT"] == str(tmp_path / "local" / info["key"] / "vllm")
    assert "TORCHINDUCTOR_CACHE_DIR" not in info["env"] and info["unmanaged"] == ["TORCHINDUCTOR_CACHE_DIR"]
    assert "TORCHINDUCTOR_CACHE_DIR" in info["reason"]
    assert store.capture(info["key"], info["fields"], cache_tree(tmp_path / "n1"), CAP).published
    assert plan_kernel_cache(spec, source_id="a" * 16, device_type="cpu", kc_store=store)["status"] == "found"  # restored (hit) only at launch


def test_cache_list_and_rm(tmp_path: Path) -> None:
    root = tmp_path / "store"
    fields = fields_for()
    key = cache_key(fields)
    assert kc(root).capture(key, fields, cache_tree(tmp_path / "n1"), CAP, model="/models/tiny-llama").published
    listed = run_cli("cache", "list", "--artifact-path", str(root))
    assert listed.returncode == 0 and key in listed.stdout and "tiny-llama" in listed.stdout and "vllm 0.32.0" in listed.stdout
    assert max(len(line) for line in listed.stdout.splitlines()) <= 80
    data = json.loads(run_cli("cache", "list", "--json", "--artifact-path", str(root)).stdout)
    assert data["schema"] == 1 and data["caches"][0]["key"] == key and data["caches"][0]["fields"]["engine"] == "vllm"
    bad = run_cli("cache", "rm", "nope", "--artifact-path", str(root))
    assert bad.returncode == 2 and "no kernel cache nope" in bad.stderr and "Traceback" not in bad.stderr
    assert run_cli("cache", "rm", "--artifact-path", str(root)).returncode == 2
    assert run_cli("cache", "rm", key, "--artifact-path", str(root)).returncode == 0
    assert kc(root).list() == []
    assert run_cli("store", "list", "--json", "--artifact-path", str(root)).returncode == 0


def quick_kernel_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node-local root and a TMPDIR under tmp_path, a short settle time, no cache variable of the user's;
    returns Inductor's precompiled-header folder for that TMPDIR."""
    from mxlaunch.launch import kernel

    monkeypatch.setattr(kernel, "SETTLE_S", 0.3)
    monkeypatch.setattr(kernel, "POLL_S", 0.1)
    monkeypatch.setenv("MXLAUNCH_KERNEL_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # a node whose engine never ran: nothing to seed from
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return kernel.side_dirs()["inductor_pch"]


def kernel_run(tmp_path: Path, source_id: str, engine: str = "vllm", flashinfer: str | None = None) -> tuple:
    """A launch's kernel-cache run on a fresh store, its events collected: (run, env, events, store, info);
    `flashinfer`: the FlashInfer version the key's fields say the engine has."""
    from mxlaunch.engines.sglang_argv import parse_sglang_argv
    from mxlaunch.launch import kernel

    if engine == "sglang":
        spec = parse_sglang_argv([PY, "-m", "sglang.launch_server", "--model-path", "/m"], engine_version="0.5.23")
    else:
        spec = parse_vllm_argv([PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"], engine_version="0.32.0")
    store = kc(tmp_path / "store")
    events: list[tuple[str, dict]] = []
    info = plan_kernel_cache(spec, source_id=source_id, device_type="cpu", kc_store=store)
    if flashinfer:
        info["fields"]["versions"]["flashinfer"] = flashinfer
    run = kernel.KernelCacheRun(info, store, lambda event, **f: events.append((event, f)), model="/m")
    return run, run.restore(), events, store, info


def test_a_launch_restores_then_captures_what_is_new_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxlaunch.launch import kernel

    pch = quick_kernel_runs(tmp_path, monkeypatch)
    assert pch.parent.parent == tmp_path / "tmpdir"
    argv = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    spec = parse_vllm_argv(argv, engine_version="0.32.0")
    store = kc(tmp_path / "store")

    def launch(compile_into: str | None) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        info = plan_kernel_cache(spec, source_id="a" * 16, device_type="cpu", kc_store=store)
        run = kernel.KernelCacheRun(info, store, lambda event, **f: events.append((event, f)), model="/m")
        env = run.restore()
        if compile_into:  # the "engine" compiles something, and builds Inductor's precompiled header once
            Path(env["TRITON_CACHE_DIR"], compile_into).write_bytes(b"kernel")
            pch.mkdir(parents=True, exist_ok=True)
            (pch / "c0ffee.h.gch").write_bytes(b"pch" * 1000)
        run.start_capture()
        run._thread.join(120)
        assert not run._thread.is_alive(), "the capture thread did not finish"
        run.stop()
        return events

    first = launch("k1.bin")
    assert first[0][0] == "kernel-cache" and first[0][1]["status"] == "miss"
    assert first[1][0] == "kernel-cache-capture" and first[1][1]["status"] == "miss" and first[1][1]["published"], first
    import shutil

    shutil.rmtree(tmp_path / "local")  # a fresh node: nothing local, no precompiled header in its TMPDIR
    shutil.rmtree(tmp_path / "tmpdir")
    second = launch(None)
    assert second[0][1]["status"] == "hit" and second[0][1]["files"] == 2
    assert (pch / "c0ffee.h.gch").read_bytes() == b"pch" * 1000
    assert second[1][1]["status"] == "hit" and not second[1][1]["published"]
    third = launch("k2.bin")  # the same node compiles one more kernel: a partial hit, captured again
    assert third[1][1]["status"] == "partial" and third[1][1]["published"] and third[1][1]["new"] == ["triton/k2.bin"]
    assert third[1][1]["new_by_cache"] == {"triton": 1}  # which library compiled: a seeding gap's first clue


def test_a_run_whose_engine_was_restored_from_a_snapshot_captures_nothing(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42: after an engine-snapshot restore the launcher never restored the cache, so the node-local folder
    (231 files the first run compiled) was all "new" to the capture: `status=miss … new_files=231`. A restored
    engine compiles nothing: the run says the cache is off and why, and captures nothing."""
    from mxlaunch.launch import kernel

    quick_kernel_runs(tmp_path, monkeypatch)
    spec = parse_vllm_argv([PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"], engine_version="0.32.0")
    store = kc(tmp_path / "store")
    events: list[tuple[str, dict]] = []
    info = plan_kernel_cache(spec, source_id="a" * 16, device_type="cpu", kc_store=store)
    assert info["status"] == "miss"
    Path(info["dir"], "triton").mkdir(parents=True)
    Path(info["dir"], "triton", "k1.bin").write_bytes(b"kernel")  # what the snapshotted run compiled on this node
    run = kernel.KernelCacheRun(info, store, lambda event, **f: events.append((event, f)), model="/m")
    assert run.skip("restored") == {}
    run.judge_ready()
    run.start_capture()
    run.finish(5.0)
    assert events == [("kernel-cache", {"status": "off", "reason": "restored", "key": info["key"]})], events
    assert run.status == "off" and run._thread is None and store.list() == []


def test_a_capture_given_up_at_the_launchers_stop_says_so_then_nothing_more(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42: the launcher's events end with `exit`; a capture still running when it stops must not report
    after that."""
    import threading

    quick_kernel_runs(tmp_path, monkeypatch)
    run, env, events, store, _ = kernel_run(tmp_path, "c" * 16)
    entered, release = threading.Event(), threading.Event()
    real = store.capture

    def slow(*args: object, **kw: object) -> object:
        entered.set()
        release.wait(60.0)
        return real(*args, **kw)

    monkeypatch.setattr(store, "capture", slow)
    Path(env["TRITON_CACHE_DIR"], "k1.bin").write_bytes(b"kernel")
    run.start_capture()
    assert entered.wait(60.0), events
    run.stop(timeout=0.1)
    said = [f for e, f in events if e == "kernel-cache-capture"]
    assert len(said) == 1 and "given up" in said[0]["reason"], events
    release.set()
    run._thread.join(60.0)
    assert not run._thread.is_alive() and [f for e, f in events if e == "kernel-cache-capture"] == said, events


def test_a_first_serve_on_a_node_where_the_engine_ran_starts_from_its_default_caches(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A miss into an empty key folder is seeded from where the engine keeps its caches by default (copies: the
    H200's first serve rebuilt 18 s of JIT the node already had), downloaded cubins and other torch builds'
    headers left out; the seeded files go into the capture; a key folder that has files, or default folders
    larger than the archive's cap, are not seeded."""
    from mxlaunch.launch import kernel

    quick_kernel_runs(tmp_path, monkeypatch)
    home = tmp_path / "home"
    (home / ".triton" / "cache" / "ab").mkdir(parents=True)
    (home / ".triton" / "cache" / "ab" / "k.cubin").write_bytes(b"cubin")
    (home / ".cache" / "flashinfer" / "90" / "cached_ops").mkdir(parents=True)
    (home / ".cache" / "flashinfer" / "90" / "cached_ops" / "sampling.so").write_bytes(b"so")
    (home / ".cache" / "flashinfer" / "cubins").mkdir()
    (home / ".cache" / "flashinfer" / "cubins" / "big.cubin").write_bytes(b"x" * 100)
    inductor = tmp_path / "tmpdir" / f"torchinductor_{__import__('getpass').getuser()}"
    (inductor / "fx").mkdir(parents=True)
    (inductor / "fx" / "graph.py").write_bytes(b"graph")
    (inductor / "precompiled_headers").mkdir()
    (inductor / "precompiled_headers" / "other.h.gch").write_bytes(b"pch")
    triton_before = os.stat(home / ".triton" / "cache" / "ab" / "k.cubin")

    run, env, events, store, info = kernel_run(tmp_path, "s" * 16)
    [(name, ev)] = events
    assert name == "kernel-cache" and ev["status"] == "miss" and ev["seeded_files"] == 3, ev
    assert Path(env["TRITON_CACHE_DIR"], "ab", "k.cubin").read_bytes() == b"cubin"
    assert Path(env["FLASHINFER_WORKSPACE_BASE"], ".cache", "flashinfer", "90", "cached_ops", "sampling.so").exists()
    assert not Path(env["FLASHINFER_WORKSPACE_BASE"], ".cache", "flashinfer", "cubins").exists()
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"], "fx", "graph.py").exists()
    assert not Path(env["TORCHINDUCTOR_CACHE_DIR"], "precompiled_headers").exists()
    assert os.stat(Path(env["TRITON_CACHE_DIR"], "ab", "k.cubin")).st_ino != triton_before.st_ino  # a copy
    run.start_capture()
    run._thread.join(120)
    run.stop()
    captured = [f for e, f in events if e == "kernel-cache-capture"]
    assert captured and captured[0]["published"] and captured[0]["files"] == 3, captured

    again, _, events2, _, _ = kernel_run(tmp_path, "s" * 16)  # the same node: its key folder is no longer empty
    assert "seeded_files" not in events2[0][1] and events2[0][1]["status"] in ("hit", "local"), events2
    monkeypatch.setenv("MXLAUNCH_KERNEL_CACHE_MAX_GIB", str(4 / 2**30))  # 4 bytes: the defaults hold more
    capped, _, events3, _, _ = kernel_run(tmp_path / "other", "t" * 16)
    assert events3[0][1]["seeded_files"] == 0 and "cap" in events3[0][1]["reason"], events3


def test_a_first_sglang_serve_starts_from_where_sglang_alone_kept_its_caches(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang 0.5.2x's `import sglang` points Triton, Inductor, the PTX cache, TileLang and FlashInfer into
    ~/.cache/sglang (its DeepGEMM cache too): a node where SGLang ran alone keeps them there, and a first serve
    through mxlaunch seeded from the libraries' own places found nothing of it. Both are seeded now (an earlier
    SGLang's ~/.cache/deep_gemm and TileLang's ~/.tilelang/cache too); a vLLM run takes none of SGLang's."""
    quick_kernel_runs(tmp_path, monkeypatch)
    monkeypatch.delenv("SGLANG_CACHE_DIR", raising=False)
    home = tmp_path / "home"
    files = {".cache/sglang/triton/ab/k.cubin": b"cubin", ".cache/sglang/inductor/fx/g.py": b"graph",
             ".cache/sglang/nv/ComputeCache/index": b"ptx", ".cache/sglang/deep_gemm/cache/kernel.so": b"dg",
             ".cache/sglang/.cache/flashinfer/90/cached_ops/sampling.so": b"so",
             ".cache/sglang/.cache/flashinfer/cubins/big.cubin": b"downloaded", ".cache/sglang/cute_aot/obj.o": b"aot",
             ".cache/deep_gemm/old.so": b"old", ".tilelang/cache/t.so": b"tl"}
    for rel, data in files.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_bytes(data)

    run, env, events, _, _ = kernel_run(tmp_path, "g" * 16, engine="sglang")
    [(name, ev)] = events
    assert name == "kernel-cache" and ev["status"] == "miss" and ev["seeded_files"] == 8, ev
    assert Path(env["TRITON_CACHE_DIR"], "ab", "k.cubin").read_bytes() == b"cubin"
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"], "fx", "g.py").read_bytes() == b"graph"
    assert Path(env["CUDA_CACHE_PATH"], "ComputeCache", "index").read_bytes() == b"ptx"
    assert Path(env["SGLANG_DG_CACHE_DIR"], "cache", "kernel.so").read_bytes() == b"dg"
    assert Path(env["SGLANG_DG_CACHE_DIR"], "old.so").read_bytes() == b"old"
    assert Path(env["TILELANG_CACHE_DIR"], "t.so").read_bytes() == b"tl"
    assert Path(env["FLASHINFER_WORKSPACE_BASE"], ".cache", "flashinfer", "90", "cached_ops", "sampling.so").exists()
    assert not Path(env["FLASHINFER_WORKSPACE_BASE"], ".cache", "flashinfer", "cubins").exists()
    assert Path(env["SGLANG_CACHE_DIR"], "cute_aot", "obj.o").read_bytes() == b"aot"
    for moved in ("triton", "inductor", "nv", "deep_gemm", ".cache"):  # seeded into their own folders, once
        assert not Path(env["SGLANG_CACHE_DIR"], moved).exists(), moved
    run.stop()

    vllm, venv, vevents, _, _ = kernel_run(tmp_path / "v", "h" * 16)
    assert vevents[0][1]["seeded_files"] == 0, vevents  # vLLM's places are the libraries' own: empty here
    vllm.stop()


def test_inductors_triton_kernels_are_seeded_where_the_launchs_triton_cache_dir_sends_inductor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 31 (an H100, block FP8): the engine alone keeps Inductor's Triton kernels (torch.compile'd ops, vLLM's
    sampler even under --enforce-eager) in <Inductor's cache>/triton/<device>/, because TRITON_CACHE_DIR is unset;
    the launch sets TRITON_CACHE_DIR, so Inductor looks there alone — and a first serve seeded from ~/.triton/cache
    alone built them again (init engine 20.5 s against 2.9 s). They are seeded into the launch's TRITON_CACHE_DIR
    now, every device's, and not also under the key's inductor folder, where nothing would read them."""
    quick_kernel_runs(tmp_path, monkeypatch)
    home = tmp_path / "home"
    (home / ".triton" / "cache" / "ab").mkdir(parents=True)
    (home / ".triton" / "cache" / "ab" / "k.cubin").write_bytes(b"triton's own")
    inductor = tmp_path / "tmpdir" / f"torchinductor_{__import__('getpass').getuser()}"
    for device, name in (("0", "cd"), ("1", "ef")):
        (inductor / "triton" / device / name).mkdir(parents=True)
        (inductor / "triton" / device / name / "sampler.cubin").write_bytes(b"inductor's " + device.encode())
    (inductor / "fxgraph").mkdir()
    (inductor / "fxgraph" / "entry").write_bytes(b"graph")

    run, env, events, _, _ = kernel_run(tmp_path, "i" * 16)
    assert events[0][1]["seeded_files"] == 4, events
    triton = Path(env["TRITON_CACHE_DIR"])
    assert (triton / "ab" / "k.cubin").read_bytes() == b"triton's own"
    assert (triton / "cd" / "sampler.cubin").read_bytes() == b"inductor's 0"
    assert (triton / "ef" / "sampler.cubin").read_bytes() == b"inductor's 1"
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"], "fxgraph", "entry").is_file()
    assert not Path(env["TORCHINDUCTOR_CACHE_DIR"], "triton").exists()
    run.stop()

    # a shared $TMPDIR where the triton folder above the device folders is writable by others: not taken
    (inductor / "triton").chmod(0o777)
    try:
        other, oenv, oevents, _, _ = kernel_run(tmp_path / "other", "j" * 16)
        assert oevents[0][1]["seeded_files"] == 2, oevents  # Triton's own and Inductor's graph, not the devices'
        assert not Path(oenv["TRITON_CACHE_DIR"], "cd").exists()
        other.stop()
    finally:
        (inductor / "triton").chmod(0o755)


def test_every_engine_that_moves_inductors_cache_moves_tritons_too() -> None:
    """The seeding above puts Inductor's Triton kernels where TRITON_CACHE_DIR points: true only while every engine
    that sets TORCHINDUCTOR_CACHE_DIR sets TRITON_CACHE_DIR too (else Inductor would look under its own folder)."""
    from mxlaunch.engines.registry import ENGINES

    for name, engine in ENGINES.items():
        moved = dict(engine.kernel_cache_vars)
        if "TORCHINDUCTOR_CACHE_DIR" in moved:
            assert "TRITON_CACHE_DIR" in moved, name


def test_flashinfer_autotune_results_vllm_alone_left_are_seeded_where_vllm_will_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM alone keeps FlashInfer's autotune results at ~/.cache/vllm/flashinfer_autotune_cache/<FlashInfer
    version>/<arch>/<config hash>/; a launch points VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR at the key's folder, where
    vLLM looks for <config hash>/ directly — seeded there (not under the key's vllm folder, where nothing looks),
    only from this FlashInfer's folder and only when it holds one arch (another GPU's tactics would be used)."""
    quick_kernel_runs(tmp_path, monkeypatch)
    tune = tmp_path / "home" / ".cache" / "vllm" / "flashinfer_autotune_cache"
    for rel in ("0.6.1/90a/abc123/autotune_configs.json", "0.5.0/90a/old/autotune_configs.json"):
        (tune / rel).parent.mkdir(parents=True)
        (tune / rel).write_text("{}")
    run, env, events, _, _ = kernel_run(tmp_path, "f" * 16, flashinfer="0.6.1")
    assert events[0][1]["seeded_files"] == 1, events
    assert Path(env["VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR"], "abc123", "autotune_configs.json").is_file()
    assert not Path(env["VLLM_CACHE_ROOT"], "flashinfer_autotune_cache").exists()
    run.stop()

    (tune / "0.6.1" / "100a" / "def").mkdir(parents=True)  # a second GPU kind shares this home
    (tune / "0.6.1" / "100a" / "def" / "autotune_configs.json").write_text("{}")
    two, _, events2, _, _ = kernel_run(tmp_path / "two", "e" * 16, flashinfer="0.6.1")
    assert events2[0][1]["seeded_files"] == 0, events2
    two.stop()
    none, _, events3, _, _ = kernel_run(tmp_path / "none", "d" * 16)  # FlashInfer not installed: nothing
    assert events3[0][1]["seeded_files"] == 0, events3
    none.stop()


def test_precompiled_headers_other_runs_left_are_not_captured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's header folder is machine-wide: headers of other torch builds (~150 MB each) stay out of the key."""
    from mxlaunch.launch import kernel

    pch = quick_kernel_runs(tmp_path, monkeypatch)
    pch.mkdir(parents=True)
    (pch / "0ld.h.gch").write_bytes(b"stale" * 1000)  # left by another torch, before this launch
    run, env, events, store, info = kernel_run(tmp_path, "b" * 16)
    Path(env["TRITON_CACHE_DIR"], "k.bin").write_bytes(b"kernel")
    (pch / "new.h.gch").write_bytes(b"fresh" * 1000)  # built by this run
    run.start_capture()
    run._thread.join(120)
    assert not run._thread.is_alive(), "the capture thread did not finish"
    run.stop()
    assert events[-1][0] == "kernel-cache-capture" and events[-1][1]["published"], events
    assert sorted(events[-1][1]["new"]) == ["inductor_pch/new.h.gch", "triton/k.bin"]
    archive = next((tmp_path / "store" / "kernel-cache").glob("*/cache-*.tar"))
    with tarfile.open(archive) as tar:
        names = {m.name for m in tar if m.isfile()}
    assert "inductor_pch/new.h.gch" in names and "inductor_pch/0ld.h.gch" not in names, names


def test_an_archive_of_no_files_is_neither_published_nor_a_hit(tmp_path: Path) -> None:
    """Folders alone restore nothing: a capture of them publishes nothing, and an archive that holds no
    file (written by an older mxlaunch) restores as a miss, never `hit ... restored 0 files`."""
    empty = tmp_path / "node1"
    (empty / "inductor" / "fx").mkdir(parents=True)
    (empty / "triton").mkdir()
    store = kc(tmp_path / "store")
    fields = fields_for()
    key = cache_key(fields)
    captured = store.capture(key, fields, empty, CAP)
    assert not captured.published and "hold no files" in captured.reason
    assert not list((tmp_path / "store" / "kernel-cache" / key).glob("*.tar"))  # the temp archive went too
    # an archive of folders only, published the way the store publishes one
    assert store.capture(key, fields, cache_tree(tmp_path / "full"), CAP).published
    folder = tmp_path / "store" / "kernel-cache" / key
    meta = json.loads((folder / KEY_JSON).read_text())
    dirs_only = tarfile.TarInfo("inductor")
    dirs_only.type = tarfile.DIRTYPE
    make_tar(folder / meta["archive"], [(dirs_only, None)])
    data = (folder / meta["archive"]).read_bytes()
    (folder / KEY_JSON).write_text(json.dumps({**meta, "archive_bytes": len(data),
                                               "archive_sha256": __import__("hashlib").sha256(data).hexdigest()}))
    result = store.restore(key, tmp_path / "node2", CAP)
    assert result.status == "miss" and result.reason == f"kernel cache {key} holds no files"


def test_a_run_stopped_before_its_caches_settle_still_publishes_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24: a first run stopped ~10 s after ready published no kernel cache (the capture waited for the
    folders to settle and was dropped at stop). Now the stop holds the capture while the engine is being
    stopped and, once it is gone, captures what it wrote."""
    from mxlaunch.launch import kernel

    quick_kernel_runs(tmp_path, monkeypatch)
    monkeypatch.setattr(kernel, "SETTLE_S", 3600.0)  # the folders never look settled before the stop
    run, env, events, store, info = kernel_run(tmp_path, "a" * 16)
    Path(env["TRITON_CACHE_DIR"], "k1.bin").write_bytes(b"kernel")
    run.start_capture()
    run.hold()  # the stop begins: the engine may still write
    Path(env["TRITON_CACHE_DIR"], "k2.bin").write_bytes(b"written while stopping")
    assert run._thread.is_alive() and not [e for e, _ in events if e == "kernel-cache-capture"]
    run.finish(budget_s=30)  # the engine is gone
    (captured,) = [f for e, f in events if e == "kernel-cache-capture"]
    assert captured["published"] and sorted(captured["new"]) == ["triton/k1.bin", "triton/k2.bin"], captured
    assert store.lookup(info["key"])[0]["files"] == 2
