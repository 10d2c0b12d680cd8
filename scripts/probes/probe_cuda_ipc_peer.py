#!/usr/bin/env python3
"""CUDA IPC handles reach only a peer of the same uid (issue 41, docs/security.md) — the proof on a GPU.

Run as root on a GPU machine, with only torch installed (the repo on sys.path):

    python3 scripts/probes/probe_cuda_ipc_peer.py --out $OUT/cuda_ipc_peer.json

1. A source process allocates --mib MiB of random bytes on cuda:0, takes their checksum (transfer/digest.py),
   exports the allocation's CUDA IPC handle and serves it through mxlaunch's handoff socket
   (transfer/ipc_handoff.py), exactly as a P2P source does; it prints only the socket's address, as a record
   carries it.
2. A target of the same uid fetches the handles through the socket, opens them and copies the bytes
   (transfer/cuda_ipc.pull); its checksum must equal the source's.
3. Another uid (made with useradd: `mxl-probe-peer`) connects to the same socket and must be refused, with no
   handle byte in what it receives.
4. The source checks its own bytes are unchanged and reports whom it served and refused.
5. (--vmm) What the driver offers for read-only sharing: a cuMemCreate allocation exported as a POSIX fd, imported
   by a second process of the same uid, mapped with cuMemSetAccess PROT_READ — is that accepted, does a write
   through it fail, and may the importer simply ask for READWRITE instead (then read-only is the importer's
   choice, not something a source can impose)?

Prints one JSON verdict ("pass": steps 2-4 as expected); nothing else is needed on the machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
MiB = 1 << 20
OTHER = "mxl-probe-peer"
WORKER = "probe-source-1"

RAW_CONNECT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
try:
    s.connect("\0" + sys.argv[1][1:])
except OSError as exc:
    print(json.dumps({"connect_error": str(exc)})); raise SystemExit(0)
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
print(json.dumps({"got": data[4:].decode(errors="replace"), "uid": __import__("os").getuid()}))
"""


def source(args: argparse.Namespace) -> None:
    import torch

    from mxlaunch.transfer import cuda_ipc, ipc_handoff
    from mxlaunch.transfer.digest import digest
    from mxlaunch.transfer.regions import Region

    t = torch.randint(0, 256, (args.mib * MiB,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    before = digest(t)
    allocations, why = cuda_ipc.export_regions([Region(t.data_ptr(), t.numel(), 0, "cuda")])
    if not allocations:
        print(json.dumps({"error": f"no handle exported: {why}"}), flush=True)
        return
    with ipc_handoff.HandoffServer({"worker": WORKER, "allocations": allocations}) as server:
        print(json.dumps({"socket": server.address, "pid": os.getpid(), "addr": t.data_ptr(), "bytes": t.numel(),
                          "digest": before}), flush=True)
        sys.stdin.readline()
        served, refusals = server.served, list(server.refusals)
    torch.cuda.synchronize()
    print(json.dumps({"served": served, "refusals": refusals, "unchanged": digest(t) == before}), flush=True)


def target(args: argparse.Namespace) -> None:
    import torch

    from mxlaunch.transfer import cuda_ipc, ipc_handoff
    from mxlaunch.transfer.digest import digest
    from mxlaunch.transfer.tensor_set import Pair

    src = json.loads(args.source_json)
    mine = torch.zeros(src["bytes"], dtype=torch.uint8, device="cuda:0")
    t0 = time.perf_counter()
    allocations = ipc_handoff.fetch(src["socket"], pid=src["pid"], worker=WORKER)
    fetched = time.perf_counter() - t0
    pair = Pair("w", mine.data_ptr(), src["addr"], src["bytes"], 0, 0, "cuda", "cuda")
    stats = cuda_ipc.pull(allocations, [pair], torch.cuda.current_stream().cuda_stream)
    print(json.dumps({"uid": os.getuid(), "handoff_s": round(fetched, 4), "open_s": round(stats.open_seconds, 4),
                      "copy_s": round(stats.transfer_seconds, 4), "bytes": stats.bytes,
                      "exact": digest(mine) == src["digest"]}), flush=True)


def other_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER], check=True)
        return pwd.getpwnam(OTHER)


def as_other(code: str, *argv: str) -> dict:
    """Run a stdlib-only snippet as the other uid (its own gid, no supplementary group)."""
    user = other_user()
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    out = subprocess.run([python, "-c", code, *argv], user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                         cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)
    if out.returncode:
        return {"error": out.stderr[-1500:], "python": python}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- 5: read-only mappings through the VMM API --------------------------------------------------------------


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


PINNED, POSIX_FD, DEVICE, PROT_READ, PROT_READWRITE = 1, 1, 1, 1, 3


def _cuda() -> ctypes.CDLL:
    import torch

    torch.zeros(1, device="cuda:0")  # the primary context, current in this thread
    from mxlaunch.transfer.cuda_ipc import Driver

    Driver().on_device(0)
    return ctypes.CDLL("libcuda.so.1")


def _map(lib: ctypes.CDLL, handle: int, size: int, flags: int) -> tuple[int, int]:
    """(rc of cuMemSetAccess — or of the reserve or map before it, negated —, the mapped address)."""
    ptr = ctypes.c_uint64(0)
    rc = lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0),
                                 ctypes.c_ulonglong(0))
    if rc:
        return -rc, 0
    rc = lib.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0))
    if rc:
        return -rc, 0
    access = _Access(_Loc(DEVICE, 0), flags)
    return lib.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)), ptr.value


def vmm_source(args: argparse.Namespace) -> dict:
    lib = _cuda()
    prop = _Prop(PINNED, POSIX_FD, _Loc(DEVICE, 0), None, _AllocFlags())
    gran = ctypes.c_size_t(0)
    if lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0):
        return {"error": "cuMemGetAllocationGranularity failed"}
    size = gran.value
    handle = ctypes.c_ulonglong(0)
    rc = lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
    if rc:
        return {"error": f"cuMemCreate with a POSIX fd handle type: CUresult {rc}"}
    rc, ptr = _map(lib, handle.value, size, PROT_READWRITE)
    pattern = (ctypes.c_ubyte * size)(*([0x5A] * size))
    lib.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), pattern, ctypes.c_size_t(size))
    fd = ctypes.c_int(-1)
    rc = lib.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_ulonglong(handle.value), POSIX_FD,
                                          ctypes.c_ulonglong(0))
    if rc:
        return {"error": f"cuMemExportToShareableHandle: CUresult {rc}"}
    out = subprocess.run([sys.executable, __file__, "--role", "vmm-target", "--vmm-fd", str(fd.value),
                          "--vmm-size", str(size)], pass_fds=[fd.value], capture_output=True, text=True, timeout=300)
    back = (ctypes.c_ubyte * size)()
    lib.cuMemcpyDtoH_v2(back, ctypes.c_uint64(ptr), ctypes.c_size_t(size))
    seen = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {"error": out.stderr[-1500:]}
    # 0x5A: as written; 0xA5: the READWRITE importer's write landed; 0xA6: the read-only mapping's write landed
    return {**seen, "granularity": size, "source_bytes_after": [hex(b) for b in sorted(set(bytes(back)))][:4]}


def vmm_target(args: argparse.Namespace) -> None:
    lib = _cuda()
    handle = ctypes.c_ulonglong(0)
    rc = lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(args.vmm_fd), POSIX_FD)
    if rc:
        print(json.dumps({"error": f"cuMemImportFromShareableHandle: CUresult {rc}"}))
        return
    size = args.vmm_size
    read_rc, ro = _map(lib, handle.value, size, PROT_READ)
    result: dict = {"set_access_read_rc": read_rc}
    rw_rc, rw = _map(lib, handle.value, size, PROT_READWRITE)  # what a hostile importer would ask for
    result["importer_may_ask_readwrite_rc"] = rw_rc  # 0: read-only is the importer's choice, not the source's
    if rw_rc == 0:  # and it writes: 0xA5 into bytes 16-31 of the source's allocation
        rc = lib.cuMemsetD8_v2(ctypes.c_uint64(rw + 16), ctypes.c_ubyte(0xA5), ctypes.c_size_t(16))
        result["write_through_readwrite_mapping_rc"] = rc or lib.cuCtxSynchronize()
    if read_rc == 0:
        buf = (ctypes.c_ubyte * 16)()
        result["read_rc"] = lib.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(ro), ctypes.c_size_t(16))
        result["read_bytes"] = sorted(set(bytes(buf)))
        # last: a refused write may leave this context unusable
        write_rc = lib.cuMemsetD8_v2(ctypes.c_uint64(ro), ctypes.c_ubyte(0xA6), ctypes.c_size_t(16))
        result["write_through_read_mapping_rc"] = write_rc or lib.cuCtxSynchronize()
    print(json.dumps(result), flush=True)


# ---- the run --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    if os.geteuid() != 0:
        raise SystemExit("run as root: the probe makes a second user (useradd) to play the other uid")
    base = [sys.executable, __file__, "--mib", str(args.mib)]
    src = subprocess.Popen(base + ["--role", "source"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "mib": args.mib}
    try:
        line = src.stdout.readline()
        offer = json.loads(line) if line.strip() else {"error": "the source printed nothing"}
        if "error" in offer:
            raise SystemExit(f"source: {offer['error']}")
        result["record_would_carry"] = {"socket": offer["socket"]}
        out = subprocess.run(base + ["--role", "target", "--source-json", json.dumps(offer)], capture_output=True,
                             text=True, timeout=300)
        result["same_uid"] = (json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0
                              else {"error": out.stderr[-2000:]})
        other = as_other(RAW_CONNECT, offer["socket"])
        try:
            reply = json.loads(other.get("got", ""))
        except ValueError:
            reply = {}
        result["other_uid"] = {**other, "refused": isinstance(reply, dict) and set(reply) == {"refused"},
                               "handle_bytes_received": isinstance(reply, dict) and "allocations" in reply}
    finally:
        src.stdin.write("\n")
        src.stdin.flush()
        tail = src.stdout.read().strip().splitlines()
        src.wait(timeout=60)
    result["source"] = json.loads(tail[-1]) if tail else {"error": "the source printed no summary"}
    result["pass"] = bool(result["same_uid"].get("exact") and result["other_uid"]["refused"]
                          and not result["other_uid"]["handle_bytes_received"] and result["source"].get("unchanged")
                          and result["source"].get("served") == 1 and len(result["source"].get("refusals", [])) == 1)
    if args.vmm:
        try:
            result["vmm_read_only"] = vmm_source(args)
        except Exception as exc:  # noqa: BLE001 - a finding, not the verdict
            result["vmm_read_only"] = {"error": repr(exc)}
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--vmm", action="store_true", help="also step 5: read-only mappings through the VMM API")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--role", default="")
    ap.add_argument("--source-json", default="")
    ap.add_argument("--vmm-fd", type=int, default=-1)
    ap.add_argument("--vmm-size", type=int, default=0)
    args = ap.parse_args()
    if args.role:
        {"source": source, "target": target, "vmm-target": vmm_target}[args.role](args)
        return 0
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
