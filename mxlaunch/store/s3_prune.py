"""`mxlaunch store prune` on an S3 store (store/s3_store.py): the same rules as store/prune.py, on objects.

- **leftovers, always**: the parts of unpublished captures whose claim is over (`data-*`, `.nodes-*` and
  unfinished multipart uploads of a capture that will never publish);
- **with `unused_for`**: published snapshots older than that — counted from the manifest's upload, since
  launches do not stamp their last use in the bucket;
- **with `max_bytes`**: then the oldest snapshots until the prefix fits.

A source id whose claim is held is never touched (listed as kept). The node-local mirror (kernel caches,
downloaded models) is not pruned here. `dry_run` decides the same and changes nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from mxlaunch.coord.base import valid_id
from mxlaunch.store.prune import Item, PruneReport, by_age_and_size
from mxlaunch.store.snapshot import MANIFEST

if TYPE_CHECKING:
    from mxlaunch.store.s3_store import S3Store


def prune(store: "S3Store", *, unused_for: Optional[float] = None, max_bytes: Optional[int] = None,
          dry_run: bool = False, now: Optional[float] = None) -> PruneReport:
    now = time.time() if now is None else now
    report = PruneReport(store.url, dry_run, store.total_bytes())  # type: ignore[arg-type] — the URL, not a path
    kept: list[Item] = []
    for sid in sorted(store.children(store.prefix)):
        if sid.startswith(".") or sid == "kernel-cache" or not valid_id(sid):
            continue
        objs = list(store.objects(store.key(sid) + "/"))
        holder = store._holder(sid)
        published = store._published_capture(sid)
        for cid in sorted(store.capture_ids(sid) - {published}):
            size = sum(int(o["Size"]) for o in objs if o["Key"].startswith((store.key(sid, f"data-{cid}") + "/",
                                                                             store.key(sid, f".nodes-{cid}") + "/")))
            item = Item("capture", f"{sid}/{cid}", store.path_of(store.key(sid, f"data-{cid}")), size,
                        "an unpublished capture whose claim is over")
            if holder is not None:
                item.skipped = f"claimed by {holder.describe()}"
            report.items.append(item)
        manifest = next((o for o in objs if o["Key"] == store.key(sid, MANIFEST)), None)
        if manifest is not None and published not in (None, "?"):
            size = sum(int(o["Size"]) for o in objs if o["Key"].startswith(store.key(sid, f"data-{published}") + "/"))
            kept.append(Item("snapshot", sid, store.path_of(store.key(sid)), size + int(manifest["Size"]), "",
                             last_used=manifest["LastModified"].timestamp()))
    report.items += by_age_and_size(kept, report, now, unused_for, max_bytes,
                                    since="uploaded {age} ago; an S3 store counts from the upload")
    for item in report.items:
        if item.skipped or dry_run:
            continue
        sid = item.name.split("/")[0]
        if item.kind == "snapshot":
            claim = store.coordinator.try_claim(sid, ttl_s=120.0)
            if claim is None:
                item.skipped = "a capture or another prune holds its claim"
                continue
            with claim:
                store.s3.delete_object(Bucket=store.bucket, Key=store.key(sid, MANIFEST))
                store.delete_prefix(store.key(sid) + "/")
        else:
            store.discard_capture(sid, item.name.split("/", 1)[1])
    return report
