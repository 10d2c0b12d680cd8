"""Probe: which host→GPU path is fastest from a staged /dev/shm file (run once on a GPU machine).

Measures, in one process and on the same bytes: the pinned-buffer ceiling (H2D and D2H), registering a
2 MiB-page tmpfs file with cudaHostRegister (whole, or in chunks by T threads pipelined with the copies),
the same on a 4 KiB-page file, a ring of pinned buffers filled by T pread threads, the cost of getting
pinned memory (torch pin_memory vs an anonymous THP mapping registered), and D2H straight into a
registered 2 MiB-page file (capture). Writes JSON to --out. Exploration for issue 11; the decision it
led to is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mxlaunch.memory.hugepages import HUGE, MADV_COLLAPSE, FileMapping, _libc  # noqa: E402

GiB = 1 << 30
rt = torch.cuda.cudart()


def register(addr: int, n: int, flags: int = 0) -> None:
    err = rt.cudaHostRegister(addr, n, flags)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def unregister(addr: int) -> None:
    rt.cudaHostUnregister(addr)


def make_file(path: str, size: int, huge: bool, src: torch.Tensor) -> None:
    """A file of `size` bytes with random content (copied from the pinned `src`), 2 MiB pages if `huge`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, size)
    m = FileMapping(fd, size)
    if huge:
        for off in range(0, size, HUGE):
            os.pwrite(fd, b"\0", off)
        rc = _libc.madvise(m.addr, size, MADV_COLLAPSE)
        if rc != 0:
            print("MADV_COLLAPSE failed", ctypes.get_errno(), file=sys.stderr)
    n = src.numel()
    srcv = memoryview(src.numpy())
    for off in range(0, size, n):
        k = min(n, size - off)
        m.view[off:off + k] = srcv[:k]
        src.add_(1)  # next chunk differs
    m.close()
    os.close(fd)


def timed(fn, *a):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn(*a)
    torch.cuda.synchronize()
    return time.perf_counter() - t, r


def reg_pipeline(path: str, dst: torch.Tensor, chunk: int, threads: int, flags: int = 0) -> dict:
    """Register the file in chunks from `threads` threads; copy each chunk once registered."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDWR)
    m = FileMapping(fd, size)
    stream = torch.cuda.Stream()
    dflat = dst.view(torch.uint8).reshape(-1)
    offs = list(range(0, size, chunk))
    pool = ThreadPoolExecutor(threads)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    futs = [pool.submit(register, m.addr + o, min(chunk, size - o), flags) for o in offs]
    with torch.cuda.stream(stream):
        for o, f in zip(offs, futs):
            f.result()
            k = min(chunk, size - o)
            src = torch.frombuffer(m.view[o:o + k], dtype=torch.uint8)
            dflat[o:o + k].copy_(src, non_blocking=True)
    stream.synchronize()
    t1 = time.perf_counter()
    list(pool.map(lambda o: unregister(m.addr + o), offs))
    t2 = time.perf_counter()
    pool.shutdown()
    m.close()
    os.close(fd)
    return {"gibps_copy_done": size / GiB / (t1 - t0), "unregister_s": t2 - t1,
            "gibps_with_unregister": size / GiB / (t2 - t0)}


def reg_whole(path: str, dst: torch.Tensor) -> dict:
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDWR)
    m = FileMapping(fd, size)
    t0 = time.perf_counter()
    register(m.addr, size)
    t1 = time.perf_counter()
    src = torch.frombuffer(m.view, dtype=torch.uint8)
    dst.view(torch.uint8).reshape(-1)[:size].copy_(src)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    unregister(m.addr)
    t3 = time.perf_counter()
    m.close()
    os.close(fd)
    return {"register_gibps": size / GiB / (t1 - t0), "copy_gibps": size / GiB / (t2 - t1),
            "unregister_s": t3 - t2, "total_gibps": size / GiB / (t3 - t0)}


def ring(path: str, dst: torch.Tensor, threads: int, slot: int, slots: torch.Tensor) -> dict:
    """`threads` pread workers fill pinned slots; the main thread copies them on a stream."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    nslots = slots.numel() // slot
    stream = torch.cuda.Stream()
    dflat = dst.view(torch.uint8).reshape(-1)
    events = [None] * nslots
    free = threading.Semaphore(nslots)
    views = [memoryview(slots[i * slot:(i + 1) * slot].numpy()) for i in range(nslots)]
    offs = list(range(0, size, slot))
    lock = threading.Lock()
    next_slot = [0]

    def read(o: int) -> tuple[int, int, int]:
        free.acquire()
        with lock:
            s = next_slot[0] % nslots
            next_slot[0] += 1
        ev = events[s]
        if ev is not None:
            ev.synchronize()
        k = min(slot, size - o)
        done = 0
        while done < k:
            done += os.preadv(fd, [views[s][done:k]], o + done)
        return s, o, k

    pool = ThreadPoolExecutor(threads)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    futs = [pool.submit(read, o) for o in offs]
    with torch.cuda.stream(stream):
        for f in futs:
            s, o, k = f.result()
            dflat[o:o + k].copy_(slots[s * slot:s * slot + k], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            events[s] = ev
            free.release()
    stream.synchronize()
    t1 = time.perf_counter()
    pool.shutdown()
    os.close(fd)
    return {"gibps": size / GiB / (t1 - t0)}


def anon_thp_register(n: int) -> dict:
    PROT = 3
    MAP = 0x02 | 0x20  # private anonymous
    base = _libc.mmap(None, n + HUGE, PROT, MAP, -1, 0)
    addr = (base + HUGE - 1) // HUGE * HUGE
    t0 = time.perf_counter()
    _libc.madvise(addr, n, 14)  # MADV_HUGEPAGE
    ctypes.memset(addr, 0, n)
    t1 = time.perf_counter()
    register(addr, n)
    t2 = time.perf_counter()
    unregister(addr)
    _libc.munmap(base, n + HUGE)
    return {"touch_gibps": n / GiB / (t1 - t0), "register_gibps": n / GiB / (t2 - t1),
            "total_gibps": n / GiB / (t2 - t0)}


def d2h_into_file(path: str, src: torch.Tensor, chunk: int, threads: int) -> dict:
    """Capture: a new 2 MiB-page file, registered in chunks, D2H straight into it."""
    size = src.numel() * src.element_size()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, size)
    m = FileMapping(fd, size)
    offs = list(range(0, size, chunk))

    def prep(o: int) -> None:
        k = min(chunk, size - o)
        for x in range(o, o + k, HUGE):
            os.pwrite(fd, b"\0", x)
        _libc.madvise(m.addr + o, k, MADV_COLLAPSE)
        register(m.addr + o, k)

    pool = ThreadPoolExecutor(threads)
    futs = [pool.submit(prep, o) for o in offs]
    stream = torch.cuda.Stream()
    sflat = src.view(torch.uint8).reshape(-1)
    with torch.cuda.stream(stream):
        for o, f in zip(offs, futs):
            f.result()
            k = min(chunk, size - o)
            torch.frombuffer(m.view[o:o + k], dtype=torch.uint8).copy_(sflat[o:o + k], non_blocking=True)
    stream.synchronize()
    t1 = time.perf_counter()
    list(pool.map(lambda o: unregister(m.addr + o), offs))
    t2 = time.perf_counter()
    ok = bool(torch.equal(torch.frombuffer(m.view[:64 << 20], dtype=torch.uint8).cuda(), sflat[:64 << 20]))
    pool.shutdown()
    m.close()
    os.close(fd)
    os.unlink(path)
    return {"gibps_copy_done": size / GiB / (t1 - t0), "gibps_with_unregister": size / GiB / (t2 - t0),
            "exact_head": ok}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--out", default="probe.json")
    args = ap.parse_args()
    size = int(args.gib * GiB) // HUGE * HUGE
    res: dict = {"size_gib": size / GiB, "cpus": os.cpu_count(), "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0)}
    for f in ("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/kernel/mm/transparent_hugepage/shmem_enabled"):
        try:
            res[f] = Path(f).read_text().strip()
        except OSError as e:
            res[f] = str(e)
    res["dev_shm_mount"] = [l for l in Path("/proc/mounts").read_text().splitlines() if "/dev/shm" in l]
    t = time.perf_counter()
    pin = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    res["pin_alloc_gibps"] = size / GiB / (time.perf_counter() - t)
    pin.random_()
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    h2d = [size / GiB / timed(dst.copy_, pin)[0] for _ in range(3)]
    d2h = [size / GiB / timed(pin.copy_, dst)[0] for _ in range(3)]
    res["ceiling_h2d"], res["ceiling_d2h"] = h2d, d2h
    print(json.dumps(res), flush=True)
    src = torch.empty(256 << 20, dtype=torch.uint8).random_()
    huge_f, small_f = "/dev/shm/probe-huge", "/dev/shm/probe-4k"
    t = time.perf_counter()
    make_file(huge_f, size, True, src.clone())
    res["make_huge_s"] = time.perf_counter() - t
    t = time.perf_counter()
    make_file(small_f, size, False, src.clone())
    res["make_4k_s"] = time.perf_counter() - t
    gold = torch.empty(size, dtype=torch.uint8, device="cuda")
    res["reg_whole_huge"] = reg_whole(huge_f, gold)
    res["reg_whole_4k"] = reg_whole(small_f, dst)
    res["same_bytes"] = bool(torch.equal(gold, dst))
    print(json.dumps(res), flush=True)
    for chunk in (64 << 20, 256 << 20):
        for th in (1, 4, 8, 16):
            dst.zero_()
            r = reg_pipeline(huge_f, dst, chunk, th)
            r["exact"] = bool(torch.equal(gold, dst))
            res[f"reg_pipe_huge_{chunk >> 20}M_t{th}"] = r
    for th in (4, 16):
        res[f"reg_pipe_4k_64M_t{th}"] = reg_pipeline(small_f, dst, 64 << 20, th)
    try:
        res["reg_pipe_huge_readonly_flag"] = reg_pipeline(huge_f, dst, 64 << 20, 8, flags=8)
    except RuntimeError as e:
        res["reg_pipe_huge_readonly_flag"] = str(e)
    print(json.dumps(res), flush=True)
    slots = torch.empty(16 * (64 << 20), dtype=torch.uint8, pin_memory=True)
    for f, tag in ((huge_f, "huge"), (small_f, "4k")):
        for th in (4, 8, 16):
            dst.zero_()
            r = ring(f, dst, th, 64 << 20, slots)
            r["exact"] = bool(torch.equal(gold, dst))
            res[f"ring_{tag}_t{th}"] = r
    res["anon_thp_register_1g"] = anon_thp_register(1 << 30)
    t = time.perf_counter()
    x = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    res["torch_pin_alloc_1g_gibps"] = 1 / (time.perf_counter() - t)
    del x
    print(json.dumps(res), flush=True)
    for th in (4, 8, 16):
        res[f"d2h_into_file_64M_t{th}"] = d2h_into_file("/dev/shm/probe-cap", gold, 64 << 20, th)
    os.unlink(huge_f)
    os.unlink(small_f)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
