#!/usr/bin/env python3
"""Benchmark `mxlaunch stage` against servekit-style `dd` slicing, `cp` and fio, in one run.

Same files for every method (≥ 4 files, odd sizes, random bytes on the real disk), the destination
in /dev/shm, the page cache dropped before every run (as root). Each method runs as a child process
and is charged its wall time and its CPU seconds (user+sys, from wait4) — for the dd method, of all
its processes. fio reads only (no destination): it is the disk's read ceiling. A separate probe
measures how fast the destination takes writes from memory, to show writes are not the bottleneck.

    python scripts/bench/bench_stage.py --src-dir /var/tmp/mxbench --total 4GiB --out bench_stage.json

Writes JSON (--out) and prints a markdown table. Only the standard library, psutil and xxhash are
needed (the GPU machine has no package index): the mxlaunch method runs the same StageJob engine
as the CLI through `mxlaunch.stage.run_stage`, without the CLI's typer/rich layer.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

GiB = 1 << 30
MiB = 1 << 20


def parse_size(text: str) -> int:
    from mxlaunch.staging.capacity import parse_size as _parse

    return _parse(text)


def make_files(src_dir: Path, total: int, count: int) -> list[Path]:
    """`count` files of odd sizes summing to about `total`, random bytes (reused if already there)."""
    src_dir.mkdir(parents=True, exist_ok=True)
    base = total // count
    sizes = [base + (n * 7919 * 4096 + 12345 + n) for n in range(count)]  # odd, different sizes
    block = os.urandom(64 * MiB)
    paths = []
    for n, size in enumerate(sizes):
        path = src_dir / f"shard-{n:02d}-of-{count:02d}.bin"
        if not path.exists() or path.stat().st_size != size:
            with open(path, "wb") as fh:
                written = 0
                while written < size:
                    piece = block[: min(len(block), size - written)]
                    fh.write(n.to_bytes(4, "little") + written.to_bytes(8, "little") + piece[12:])
                    written += len(piece)
                fh.flush()
                os.fsync(fh.fileno())
        paths.append(path)
    return paths


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_children(cmds: list[list[str]]) -> tuple[float, float, list[int]]:
    """Start all commands at once; return (wall s, CPU s of all of them, exit codes)."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for cmd in cmds]
    cpu = 0.0
    codes = []
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        codes.append(proc.returncode)
        cpu += usage.ru_utime + usage.ru_stime
    wall = time.perf_counter() - t0
    for proc in procs:
        if proc.returncode:
            sys.stderr.write((proc.stderr.read() if proc.stderr else b"").decode()[-2000:])
    return wall, cpu, codes


def run_one_child(cmd: list[str]) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read() if proc.stdout else b""
    err = proc.stderr.read() if proc.stderr else b""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {err.decode()[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, out.decode()


def method_mxlaunch(files: list[Path], dest: Path, cfg: MxConfig, chunk: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stage-worker", "--dest", str(dest),
           "--readers", str(cfg.readers), "--chunk", str(chunk), "--write-mode", cfg.mode,
           "--per-file", str(cfg.per_file), "--huge", str(int(cfg.huge)),
           *map(str, files)]
    wall, cpu, out = run_one_child(cmd)
    report = json.loads(out)
    return {"wall_s": wall, "cpu_s": cpu, "engine_s": report["seconds"], "o_direct": report["o_direct"],
            "huge_bytes": report.get("huge_bytes", 0), "huge_note": report.get("huge_note")}


def method_dd(files: list[Path], dest: Path, slices_per_file: int) -> dict:
    dest.mkdir(parents=True, exist_ok=True)
    bs = 16 * MiB
    cmds = []
    for f in files:
        size = f.stat().st_size
        target = dest / f.name
        with open(target, "wb") as fh:
            fh.truncate(size)
        blocks = math.ceil(size / bs)
        per = math.ceil(blocks / slices_per_file)
        for start in range(0, blocks, per):
            cmds.append(["dd", f"if={f}", f"of={target}", f"bs={bs}", "iflag=direct", "conv=notrunc",
                         f"skip={start}", f"seek={start}", f"count={per}", "status=none"])
    wall, cpu, codes = run_children(cmds)
    if any(codes):
        raise RuntimeError("dd slice failed")
    return {"wall_s": wall, "cpu_s": cpu, "processes": len(cmds)}


def method_cp(files: list[Path], dest: Path) -> dict:
    dest.mkdir(parents=True, exist_ok=True)
    wall, cpu, _ = run_one_child(["cp", *map(str, files), str(dest) + "/"])
    return {"wall_s": wall, "cpu_s": cpu}


def method_fio(files: list[Path], fio: str, jobs: int, depth: int, bs: int) -> dict:
    """O_DIRECT reads of all files: `jobs` readers per file over disjoint ranges, queue depth `depth`."""
    args = [fio, "--output-format=json", "--group_reporting", "--direct=1", "--rw=read", f"--bs={bs}",
            "--ioengine=libaio", f"--iodepth={depth}", "--thread"]
    for n, f in enumerate(files):
        size = f.stat().st_size
        part = (size // jobs) // bs * bs or bs
        args += [f"--name=f{n}", f"--filename={f}", f"--numjobs={jobs}", f"--size={part}",
                 f"--offset_increment={part}"]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed: {proc.stderr[-1500:]}")
    data = json.loads(proc.stdout[proc.stdout.index("{"):])
    read = data["jobs"][0]["read"]
    return {"gib_per_s": read["bw_bytes"] / GiB, "bytes": read["io_bytes"], "wall_s": wall,
            "cpu_s": None, "jobs_per_file": jobs, "iodepth": depth}


def dest_write_probe(dest_root: Path, total: int, threads: int) -> float:
    """GiB/s of writing from memory into the destination filesystem (the other side of the copy)."""
    dest_root.mkdir(parents=True, exist_ok=True)
    buf = os.urandom(16 * MiB)
    per = total // threads

    def writer(n: int) -> None:
        with open(dest_root / f"probe{n}", "wb", buffering=0) as fh:
            for _ in range(per // len(buf)):
                fh.write(buf)

    t0 = time.perf_counter()
    pool = [threading.Thread(target=writer, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    shutil.rmtree(dest_root)
    return (per // len(buf)) * len(buf) * threads / GiB / seconds


@dataclass(frozen=True)
class MxConfig:
    """One mxlaunch configuration: 'mode:readers:per_file[:huge]' (per_file 0: none; huge 0: 4 KiB pages)."""

    mode: str
    readers: int
    per_file: int = 0
    huge: bool = True

    @classmethod
    def parse(cls, spec: str) -> MxConfig:
        parts = spec.split(":")
        mode, readers, cap = parts[0], int(parts[1]), int(parts[2])
        huge = bool(int(parts[3])) if len(parts) > 3 else True
        return cls(mode, readers, cap, huge)

    def label(self) -> str:
        text = f"{self.mode}, readers={self.readers}"
        text += f", per-file={self.per_file}" if self.per_file else ""
        return text + ("" if self.huge else ", 4 KiB pages")


def mx_configs(args: argparse.Namespace) -> list[MxConfig]:
    if args.configs:
        return [MxConfig.parse(spec) for spec in args.configs.split(";")]
    out = []
    for mode in args.modes.split(","):
        for cap in [int(c) for c in args.per_file.split(",")]:
            for readers in [int(r) for r in args.readers.split(",")]:
                if not cap or cap < readers:  # a cap ≥ readers changes nothing
                    out.append(MxConfig(mode, readers, cap))
    return out


def dest_page_probe(dest_root: Path, total: int) -> dict:
    """CPU s per GiB of filling a fresh tmpfs file from memory (one thread, page cache just dropped):
    4 KiB pages (pwrite) vs 2 MiB pages made by MADV_COLLAPSE first (what mxlaunch does), so the
    destination's own cost is on record next to each method's."""
    from mxlaunch.memory.hugepages import FileMapping, HugePager

    dest_root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(16 * MiB)
    out = {}
    for name in ("4k_pwrite", "collapse_then_pwrite"):
        drop_caches()
        time.sleep(3)  # what a stage right after a cache drop meets (freed memory settles/is reported)
        path = dest_root / "page-probe"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, total)
        mapping = FileMapping(fd, total)
        pager = HugePager(max_cpu_s_per_gib=1e9, probe_bytes=0)
        t0, c0 = time.perf_counter(), time.thread_time()
        for off in range(0, total, len(block)):
            if name != "4k_pwrite":
                pager.prepare(mapping, fd, off, off + len(block))
            os.pwrite(fd, block, off)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
        mapping.close()
        os.close(fd)
        path.unlink()
        out[name] = {"cpu_s_per_gib": cpu / (total / GiB), "wall_s_per_gib": wall / (total / GiB),
                     "collapsed": pager.collapsed, "note": pager.reason}
        print(f"destination page probe {name}: {out[name]['cpu_s_per_gib']:.3f} CPU s/GiB", file=sys.stderr)
    shutil.rmtree(dest_root, ignore_errors=True)
    return out


def stage_worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage-worker", action="store_true")
    parser.add_argument("--dest", required=True)
    parser.add_argument("--readers", type=int, required=True)
    parser.add_argument("--chunk", type=int, required=True)
    parser.add_argument("--write-mode", default="pwrite")
    parser.add_argument("--per-file", type=int, default=0)
    parser.add_argument("--huge", type=int, default=1)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    from mxlaunch.stage import StageRequest, plan_items, run_stage

    request = StageRequest(sources=args.files, dest=Path(args.dest), readers=args.readers, chunk_size=args.chunk,
                           write_mode=args.write_mode, per_file=args.per_file or None,
                           huge_pages=bool(args.huge))
    items, layouts = plan_items(request)
    result = run_stage(request, items, layouts)
    print(json.dumps({"seconds": result.seconds, "bytes": result.bytes, "o_direct": result.o_direct,
                      "huge_bytes": result.huge_bytes, "huge_note": result.huge_note}))


def main() -> None:
    if "--stage-worker" in sys.argv:
        stage_worker(sys.argv[1:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src-dir", type=Path, default=Path(tempfile.gettempdir()) / "mxlaunch-bench-src",
                    help="where the source files are made (a real disk, not tmpfs)")
    ap.add_argument("--dest-root", type=Path, default=Path("/dev/shm/mxlaunch-bench"))
    ap.add_argument("--total", default="4GiB")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--readers", default="1,4,16,64", help="reader-count sweep for mxlaunch")
    ap.add_argument("--configs", default=None,
                    help="explicit mxlaunch configs 'mode:readers:per_file;...' (overrides the sweep)")
    ap.add_argument("--chunk", default="16MiB")
    ap.add_argument("--modes", default="pwrite,mmap", help="mxlaunch write modes to measure")
    ap.add_argument("--per-file", default="0", help="per-file in-flight caps to sweep (0: none)")
    ap.add_argument("--dd-slices", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="runs per method; the best is reported")
    ap.add_argument("--fio", default=shutil.which("fio"), help="path to fio (skipped when missing)")
    ap.add_argument("--fio-grid", default="1x1,1x16,4x4,4x8,16x1,16x2",
                    help="jobs-per-file x iodepth points (total in flight × 16 MiB must fit in RAM)")
    ap.add_argument("--machine", default=None, help="machine description for the record")
    ap.add_argument("--out", type=Path, default=Path("bench_stage.json"))
    ap.add_argument("--keep-src", action="store_true")
    ap.add_argument("--page-probe", action="store_true",
                    help="also measure the CPU cost of filling tmpfs with 4 KiB vs 2 MiB pages")
    args = ap.parse_args()

    load_start = os.getloadavg()
    total = parse_size(args.total)
    chunk = parse_size(args.chunk)
    files = make_files(args.src_dir, total, args.files)
    file_sizes = [{"name": f.name, "bytes": f.stat().st_size} for f in files]
    nbytes = sum(entry["bytes"] for entry in file_sizes)
    cache_dropped = drop_caches()
    results: list[dict] = []

    def record(method: str, params: str, run: dict) -> None:
        run.setdefault("gib_per_s", nbytes / GiB / run["wall_s"])
        run["cpu_s_per_gib"] = None if run.get("cpu_s") is None else run["cpu_s"] / (nbytes / GiB)
        entry = {"method": method, "params": params, **run}
        results.append(entry)
        cpu = "" if entry["cpu_s_per_gib"] is None else f", {entry['cpu_s_per_gib']:.3f} CPU s/GiB"
        print(f"  {method:10s} {params:22s} {entry['gib_per_s']:6.2f} GiB/s{cpu}", file=sys.stderr, flush=True)

    def fresh_dest(name: str) -> Path:
        shutil.rmtree(args.dest_root, ignore_errors=True)
        drop_caches()
        return args.dest_root / name

    write_probe = dest_write_probe(args.dest_root / "probe", min(total, 4 * GiB), 4)
    print(f"destination write probe: {write_probe:.2f} GiB/s", file=sys.stderr)
    page_probe = dest_page_probe(args.dest_root / "pages", min(total, 2 * GiB)) if args.page_probe else None
    for _ in range(args.repeats):
        for cfg in mx_configs(args):
            record("mxlaunch", cfg.label(), method_mxlaunch(files, fresh_dest("mx"), cfg, chunk))
        record("dd-slices", f"{args.dd_slices}/file, bs=16M", method_dd(files, fresh_dest("dd"), args.dd_slices))
        record("cp", "", method_cp(files, fresh_dest("cp")))
        if args.fio:
            for point in args.fio_grid.split(","):
                jobs, depth = (int(x) for x in point.split("x"))
                drop_caches()
                record("fio", f"jobs/file={jobs}, qd={depth}", method_fio(files, args.fio, jobs, depth, 16 * MiB))
    shutil.rmtree(args.dest_root, ignore_errors=True)
    if not args.keep_src:
        shutil.rmtree(args.src_dir, ignore_errors=True)

    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["method"], r["params"]), []).append(r)
    table = [summarize_group(method, params, runs) for (method, params), runs in groups.items()]

    def best(method: str) -> dict | None:
        rows = [row for row in table if row["method"] == method]
        return max(rows, key=lambda row: row["median_gib_per_s"]) if rows else None

    mx, dd, fio = best("mxlaunch"), best("dd-slices"), best("fio")
    ratios = {
        "mxlaunch_vs_fio_best": mx["median_gib_per_s"] / fio["median_gib_per_s"] if fio else None,
        "mxlaunch_vs_dd_gib_per_s": mx["median_gib_per_s"] / dd["median_gib_per_s"],
        "mxlaunch_vs_dd_cpu_per_gib": mx["median_cpu_s_per_gib"] / dd["median_cpu_s_per_gib"],
        "basis": "medians over repeats; mxlaunch = its config with the best median GiB/s",
    }
    summary = {
        "schema": 1,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": args.machine or f"{platform.node()} ({os.cpu_count()} cores)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "files": file_sizes,
        "bytes": nbytes,
        "page_cache_dropped": cache_dropped,
        "dest_write_gib_per_s": write_probe,
        "dest_page_probe": page_probe,
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "results": results,
        "table": table,
        "best": {"mxlaunch": mx, "dd-slices": dd, "fio": fio, "cp": best("cp")},
        "ratios": ratios,
    }
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(markdown(summary))


def summarize_group(method: str, params: str, runs: list[dict]) -> dict:
    speeds = sorted(r["gib_per_s"] for r in runs)
    cpus = sorted(r["cpu_s_per_gib"] for r in runs if r.get("cpu_s_per_gib") is not None)
    return {
        "method": method,
        "params": params,
        "runs": len(runs),
        "median_gib_per_s": statistics.median(speeds),
        "min_gib_per_s": speeds[0],
        "max_gib_per_s": speeds[-1],
        "median_cpu_s_per_gib": statistics.median(cpus) if cpus else None,
    }


def markdown(summary: dict) -> str:
    lines = [f"Machine: {summary['machine']} · {summary['date']} · {summary['bytes'] / GiB:.2f} GiB in "
             f"{len(summary['files'])} files · page cache dropped: {summary['page_cache_dropped']} · "
             f"destination write probe {summary['dest_write_gib_per_s']:.2f} GiB/s",
             "", "| method | parameters | runs | GiB/s median (min–max) | CPU s per GiB (median) |",
             "|---|---|---|---|---|"]
    for row in summary["table"]:
        cpu = "—" if row["median_cpu_s_per_gib"] is None else f"{row['median_cpu_s_per_gib']:.3f}"
        lines.append(f"| {row['method']} | {row['params']} | {row['runs']} | {row['median_gib_per_s']:.2f} "
                     f"({row['min_gib_per_s']:.2f}–{row['max_gib_per_s']:.2f}) | {cpu} |")
    ratios = summary["ratios"]
    mx = summary["best"]["mxlaunch"]
    lines += ["", f"Ratios on medians; mxlaunch at its best config ({mx['params']}).", "",
              "| ratio | value | target |", "|---|---|---|"]
    if ratios["mxlaunch_vs_fio_best"] is not None:
        lines.append(f"| mxlaunch / fio best (GiB/s) | {ratios['mxlaunch_vs_fio_best']:.2f} | ≥ 0.95 |")
    lines.append(f"| mxlaunch / dd-slices (GiB/s) | {ratios['mxlaunch_vs_dd_gib_per_s']:.2f} | ≥ 1.0 |")
    lines.append(f"| mxlaunch / dd-slices (CPU s per GiB) | {ratios['mxlaunch_vs_dd_cpu_per_gib']:.2f} | ≤ 0.5 |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
