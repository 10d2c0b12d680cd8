"""`mxlaunch store prune`: leftovers always go, used snapshots and kernel caches by age and size, claimed
things never, a dry run changes nothing — on real stores built through the store's own API."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from mxlaunch.coord.file import FileCoordinator
from mxlaunch.fileutil import LAST_USED, last_used, mark_used
from mxlaunch.kernelcache.caches import cache_key
from mxlaunch.kernelcache.archive import KernelCacheStore
from mxlaunch.store.core import MANIFEST, Store
from mxlaunch.store.prune import TRASH_AGE_S, parse_duration, prune
from tests.helpers.cli import one_line_error, run_cli
from tests.unit.test_store import META, capture, write_rank

DAY = 86400.0


def abandoned_capture(store: Store, sid: str) -> str:
    """A capture that wrote rank 0 of 2 and whose launcher died: its parts stay, its claim is over."""
    writer = store.begin_capture(sid, META, nranks=2)
    write_rank(writer, 0)
    return writer.capture_id


def used_at(folder: Path, when: float) -> None:
    mark_used(folder)
    os.utime(folder / LAST_USED, (when, when))


def snapshot_files(store: Store) -> dict[str, list[str]]:
    return {p.name: sorted(str(f.relative_to(p)) for f in p.rglob("*")) for p in store.root.iterdir()
            if not p.name.startswith(".")}


def test_leftovers_go_and_what_is_published_or_claimed_stays(tmp_path: Path) -> None:
    store = Store(tmp_path)
    stale_in_published = abandoned_capture(store, "aaaa000000000000")  # died; a second capture then published
    published = capture(store, "aaaa000000000000")
    abandoned_capture(store, "bbbb000000000000")
    held = FileCoordinator(tmp_path).try_claim("cccc000000000000")  # a capture running right now
    abandoned_capture(store, "cccc000000000000")
    old_trash = tmp_path / ".trash-dddd000000000000-0123"
    (old_trash / "x").mkdir(parents=True)
    os.utime(old_trash, (time.time() - TRASH_AGE_S - 60,) * 2)
    young_trash = tmp_path / ".trash-eeee000000000000-4567"  # a `store rm` may be deleting it right now
    young_trash.mkdir()

    before = snapshot_files(store)
    dry = prune(store, dry_run=True)
    assert snapshot_files(store) == before and old_trash.exists()  # a dry run changes nothing
    report = prune(store)

    removed = {(i.kind, i.name) for i in report.removed}
    assert removed == {("capture", f"aaaa000000000000/{stale_in_published}"), ("capture", next(
        i.name for i in dry.removed if i.name.startswith("bbbb"))), ("trash", old_trash.name),
        ("empty", "bbbb000000000000")}, removed
    assert {(i.kind, i.name) for i in dry.removed} == removed - {("empty", "bbbb000000000000")}
    skipped = [i for i in report.items if i.skipped]
    assert [i.name.split("/")[0] for i in skipped] == ["cccc000000000000"] and "claimed by" in skipped[0].skipped
    left = sorted(os.listdir(published))  # the published snapshot alone: its data folder and manifest
    assert store.verify("aaaa000000000000").ok and len(left) == 2 and left[0].startswith("data-") and left[1] == MANIFEST
    assert not (tmp_path / "bbbb000000000000").exists() and not old_trash.exists() and young_trash.exists()
    assert any(n.startswith((".tmp-", "data-")) for n in os.listdir(tmp_path / "cccc000000000000"))
    assert report.freed > 0 and report.to_dict()["bytes_after"] == report.bytes_before - report.freed
    held.release()


def test_unused_for_removes_what_no_launch_used_lately(tmp_path: Path) -> None:
    store, now = Store(tmp_path), time.time()
    old, fresh, never = (capture(store, f"{c * 4}000000000000") for c in "abc")
    used_at(old, now - 40 * DAY)
    used_at(fresh, now - 1 * DAY)
    os.utime(never / MANIFEST, (now - 2 * DAY,) * 2)  # never stamped: counts from when it was published
    caches = KernelCacheStore(tmp_path, FileCoordinator(tmp_path))
    src = tmp_path.parent / f"{tmp_path.name}-kc"
    (src / "inductor").mkdir(parents=True)
    (src / "inductor" / "k.py").write_text("kernel")
    keys = []
    for n in (1, 2):
        fields = {"engine": "vllm", "n": n}
        keys.append(cache_key(fields))
        assert caches.capture(keys[-1], fields, src, 1 << 20).published
    used_at(caches.folder(keys[0]), now - 31 * DAY)

    listed = {e.source_id: e.to_dict()["last_used"] for e in store.list()}  # `store list --json` shows it
    assert listed[old.name] == pytest.approx(now - 40 * DAY) and listed[never.name] == pytest.approx(now - 2 * DAY)
    report = prune(store, unused_for=parse_duration("30d"), now=now)

    assert {(i.kind, i.name) for i in report.removed} == {("snapshot", old.name), ("kernel-cache", keys[0])}
    assert all("unused for" in i.why for i in report.removed)
    assert not old.exists() and fresh.exists() and never.exists()
    assert [e.key for e in caches.list()] == [keys[1]]
    restored = caches.restore(keys[1], tmp_path.parent / f"{tmp_path.name}-dest", 1 << 20)
    assert restored.status == "hit" and last_used(caches.folder(keys[1]), "key.json") >= now - 5  # a hit stamps it
    assert caches.list()[0].to_dict()["last_used"] >= now - 5  # `cache list --json` shows it


def test_max_size_removes_the_least_recently_used_first(tmp_path: Path) -> None:
    store, now = Store(tmp_path), time.time()
    folders = [capture(store, f"{c * 4}000000000000") for c in "abcd"]
    for age, folder in zip((1, 4, 2, 3), folders):  # b is the oldest, then d, then c; a the newest
        used_at(folder, now - age * DAY)
    one = prune(store, dry_run=True).bytes_before // 4
    report = prune(store, max_bytes=2 * one + one // 2, now=now)
    assert [i.name for i in report.removed] == [folders[1].name, folders[3].name]
    assert all("least recently used" in i.why for i in report.removed)
    assert [f.exists() for f in folders] == [True, False, True, False]
    assert report.bytes_before - report.freed <= 2 * one + one // 2


def test_a_claimed_snapshot_is_kept_whatever_its_age(tmp_path: Path) -> None:
    store, now = Store(tmp_path), time.time()
    folder = capture(store, "aaaa000000000000")
    used_at(folder, now - 90 * DAY)
    claim = FileCoordinator(tmp_path).try_claim("aaaa000000000000")
    report = prune(store, unused_for=DAY, now=now)
    assert report.removed == [] and "claimed by" in report.items[0].skipped and folder.exists()
    claim.release()
    assert [i.name for i in prune(store, unused_for=DAY, now=now).removed] == ["aaaa000000000000"]


def test_durations_parse_and_bad_ones_are_refused() -> None:
    assert [parse_duration(t) for t in ("30d", "12h", "90m", "45s", "2w", "3600", "1.5d")] == [
        30 * DAY, 43200, 5400, 45, 14 * DAY, 3600, 1.5 * DAY]
    for bad in ("", "d", "30 days", "-1d", "1y"):
        with pytest.raises(ValueError, match="use e.g. 30d"):
            parse_duration(bad)


def test_cli_prune_json_dry_run_and_bad_input(tmp_path: Path) -> None:
    store = Store(tmp_path)
    folder = capture(store, "aaaa000000000000")
    used_at(folder, time.time() - 10 * DAY)
    abandoned_capture(store, "bbbb000000000000")

    dry = run_cli("store", "prune", "--artifact-path", str(tmp_path), "--unused-for", "7d", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    data = json.loads(dry.stdout)
    assert data["dry_run"] is True and {i["kind"] for i in data["removed"]} == {"snapshot", "capture"}
    assert folder.exists() and (tmp_path / "bbbb000000000000").exists()

    table = run_cli("store", "prune", "--artifact-path", str(tmp_path), "--unused-for", "7d")
    assert table.returncode == 0, table.stderr
    assert "removed 3 item(s)" in table.stdout and "aaaa000000000000" in table.stdout, table.stdout
    assert not folder.exists() and not (tmp_path / "bbbb000000000000").exists()

    for args, needle in ((("--unused-for", "soon"), "--unused-for"), (("--max-size", "lots"), "--max-size")):
        bad = run_cli("store", "prune", "--artifact-path", str(tmp_path), *args)
        assert bad.returncode == 2 and needle in one_line_error(bad), bad.stderr
    missing = run_cli("store", "prune", "--artifact-path", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no artifact store" in one_line_error(missing)
    assert not (tmp_path / "nope").exists()


def test_stale_p2p_records_in_the_stores_registry_go_too(tmp_path: Path) -> None:
    from mxlaunch.coord.peers_file import FileRegistry
    from tests.unit.test_peers_registry import rec

    registry = FileRegistry(tmp_path, host="node-b")  # another host: only the ttl tells (no pid check)
    live = registry.publish(rec(worker="live"), ttl_s=30)
    registry.publish(rec(worker="stale"), ttl_s=0.2)
    time.sleep(0.4)
    store = Store(tmp_path)
    assert prune(store, dry_run=True, peer_grace_s=0).stale_peer_records == 1
    assert len(FileRegistry(tmp_path).all_sources()) == 2  # the dry run removed nothing
    assert prune(store, peer_grace_s=30).stale_peer_records == 0  # not stale for long enough yet
    report = prune(store, peer_grace_s=0)
    assert report.stale_peer_records == 1 and report.to_dict()["stale_peer_records"] == 1
    assert [e.record.worker for e in FileRegistry(tmp_path).all_sources()] == ["live"]
    live.unpublish()


def test_zygote_images_are_pruned_by_use_and_never_listed_as_snapshots(tmp_path: Path) -> None:
    """An image (store/zygote_images.py) is hundreds of MB per zygote key: `store prune` removes this user's
    unused ones like kernel caches, and `store list` never takes the images' folder for a snapshot."""
    from mxlaunch.warmstart import zygote_image
    from mxlaunch.store import zygote_images

    store, now = Store(tmp_path), time.time()
    root = zygote_images.images_root(tmp_path)
    root.mkdir(parents=True, mode=0o700)
    for key in ("a" * 20, "b" * 20):
        (root / key).mkdir()
        (root / key / zygote_images.META).write_text(json.dumps({"pid": 1}))
        (root / key / "pages-1.img").write_bytes(b"x" * 4096)
    used_at(root / ("a" * 20), now - 40 * DAY)
    used_at(root / ("b" * 20), now - 1 * DAY)
    assert store.list() == []
    report = prune(store, unused_for=parse_duration("30d"), now=now)
    assert {(i.kind, i.name) for i in report.removed} == {("zygote-image", "a" * 20)}
    assert not (root / ("a" * 20)).exists() and zygote_image.find_image(tmp_path, "b" * 20) == root / ("b" * 20)
    assert (tmp_path / "zygote-images").is_dir()  # the empty-folder sweep leaves the images' root alone


def test_lean_engine_snapshots_in_the_store_are_pruned_by_use_and_never_listed_as_snapshots(tmp_path: Path) -> None:
    """A lean engine snapshot (warmstart/lean_snapshot.py) lives in the store, GBs per command: `store prune`
    removes this user's unused ones, `store list` never takes their folder for a snapshot."""
    from mxlaunch.store.core import ENGINE_SNAPSHOTS

    store, now = Store(tmp_path), time.time()
    root = tmp_path / ENGINE_SNAPSHOTS / str(os.getuid())
    root.mkdir(parents=True, mode=0o700)
    (root / "key-salt").write_bytes(b"s" * 32)
    for key in ("c" * 20, "d" * 20):
        (root / key).mkdir()
        (root / key / "meta.json").write_text(json.dumps({"lean": True}))
        (root / key / "pages-1.img").write_bytes(b"x" * 4096)
    used_at(root / ("c" * 20), now - 40 * DAY)
    used_at(root / ("d" * 20), now - 1 * DAY)
    assert store.list() == []
    report = prune(store, unused_for=parse_duration("30d"), now=now)
    assert {(i.kind, i.name) for i in report.removed} == {("engine-snapshot", "c" * 20)}
    assert not (root / ("c" * 20)).exists() and (root / ("d" * 20) / "meta.json").exists()
    assert (root / "key-salt").exists()  # the salt that makes every node's keys the same stays


def test_store_list_shows_this_users_images_and_snapshots_apart_from_the_weights(tmp_path: Path) -> None:
    """A user whose store grows by GBs of zygote images and lean snapshots sees them in `store list` (kind, key,
    size, last use), apart from the weight snapshots; a folder others could enter is not listed as theirs."""
    from mxlaunch.store import zygote_images
    from mxlaunch.store.core import ENGINE_SNAPSHOTS
    from tests.helpers.cli import run_cli

    images = zygote_images.images_root(tmp_path)
    images.mkdir(parents=True, mode=0o700)
    (images / ("a" * 20)).mkdir()
    (images / ("a" * 20) / zygote_images.META).write_text(json.dumps({"pid": 1}))
    (images / ("a" * 20) / "pages-1.img").write_bytes(b"x" * 8192)
    lean = tmp_path / ENGINE_SNAPSHOTS / str(os.getuid())
    lean.mkdir(parents=True, mode=0o700)
    (lean / ("c" * 20)).mkdir()
    (lean / ("c" * 20) / "meta.json").write_text(json.dumps({"lean": True}))
    listed = run_cli("store", "list", "--artifact-path", str(tmp_path), "--json")
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    assert doc["snapshots"] == []
    assert {(i["kind"], i["name"]) for i in doc["images"]} == {("zygote-image", "a" * 20), ("engine-snapshot", "c" * 20)}
    assert [i["bytes"] for i in doc["images"] if i["kind"] == "zygote-image"][0] >= 8192
    shown = run_cli("store", "list", "--artifact-path", str(tmp_path))
    assert "your zygote images and engine snapshots" in shown.stdout and "a" * 20 in shown.stdout, shown.stdout
    os.chmod(images, 0o755)  # others may enter: not a folder of this user's alone, nothing in it is theirs
    doc = json.loads(run_cli("store", "list", "--artifact-path", str(tmp_path), "--json").stdout)
    assert [i["kind"] for i in doc["images"]] == ["engine-snapshot"]
