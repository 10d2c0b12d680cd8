"""CUDA IPC handles reach only a peer of the source's own uid (issue 41, docs/security.md): handed over a real
abstract Unix socket after the kernel's SO_PEERCRED, never written into a P2P record. Real processes: a child of
this uid pulls the handles; the second real user (tests/helpers/second_user.py) is refused, and cannot pose as a
source at a name it read in a record. The CUDA calls stay behind the fake driver of test_cuda_ipc.py."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mxlaunch.coord.peers import local_record
from mxlaunch.coord.peers_file import FileRegistry
from mxlaunch.errors import UsageError
from mxlaunch.plugin import p2p, p2p_agent, p2p_source
from mxlaunch.transfer import cuda_ipc, ipc_handoff
from mxlaunch.transfer.regions import Region
from tests.helpers.second_user import ensure_group, intruder_or_skip
from tests.unit.test_cuda_ipc import FakeDriver

pytestmark = pytest.mark.unit

WORKER = "src-handoff-1"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def allocations(n: int = 2) -> list[dict]:
    return [{"addr": 0x1000 * (i + 1), "bytes": 4096, "handle": base64.b64encode(bytes([i + 1, 0]) * 32).decode()}
            for i in range(n)]


def fetch_in_child(address: str, pid: int, worker: str = WORKER) -> dict:
    """Another process of this uid (the project's interpreter) asks the socket, as a target worker does."""
    code = textwrap.dedent(f"""
        import json
        from mxlaunch.transfer import ipc_handoff
        try:
            print(json.dumps({{"allocations": ipc_handoff.fetch({address!r}, pid={pid}, worker={worker!r})}}))
        except ipc_handoff.HandoffError as exc:
            print(json.dumps({{"error": str(exc)}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
    return json.loads(out.stdout)


RAW_CONNECT = """
    import json, socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect("\\0" + {address!r}[1:])
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    print(json.dumps({{"got": data[4:].decode(errors="replace")}}))
"""


def test_a_process_of_the_same_uid_gets_the_handles_through_the_socket() -> None:
    payload = {"worker": WORKER, "allocations": allocations()}
    with ipc_handoff.HandoffServer(payload) as server:
        got = fetch_in_child(server.address, os.getpid())
        assert got == {"allocations": payload["allocations"]} and server.served == 1
        # the record's pid is checked against the kernel's: a socket held by another process hands nothing over
        assert "not the source" in fetch_in_child(server.address, os.getpid() + 1)["error"]
        assert "not a valid list" in fetch_in_child(server.address, os.getpid(), worker="someone-else")["error"]


@pytest.mark.parametrize("as_group_member", [False, True])
def test_another_user_is_refused_and_gets_no_handle_byte(as_group_member: bool, monkeypatch) -> None:
    """A handle is read AND write access to the live engine's weights: nobody but the uid gets one — a member of
    MXLAUNCH_GROUP neither (the group may read snapshots and records, not write into a serving engine)."""
    intruder = intruder_or_skip()
    groups = []
    if as_group_member:
        gid = ensure_group()
        monkeypatch.setenv("MXLAUNCH_GROUP", str(gid))
        groups = [gid]
    payload = {"worker": WORKER, "allocations": allocations()}
    with ipc_handoff.HandoffServer(payload) as server:
        out = intruder.python(RAW_CONNECT.format(address=server.address), groups=groups)
        got = json.loads(out.stdout)["got"]
        assert "refused" in got and f"uid {intruder.uid}" in got
        assert not any(a["handle"] in got for a in payload["allocations"]) and "allocations" not in got
        assert server.served == 0 and f"uid {intruder.uid}" in server.refusals[-1]
        # and the source goes on serving its own uid
        assert fetch_in_child(server.address, os.getpid()) == {"allocations": payload["allocations"]}


IMPOSTOR = """
    import json, socket, struct
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind("\\0" + {address!r}[1:])
    s.listen(1)
    print("ready", flush=True)
    s.settimeout(30)
    conn, _ = s.accept()
    body = json.dumps({{"worker": {worker!r}, "allocations": {fake!r}}}).encode()
    conn.sendall(struct.pack(">I", len(body)) + body)
    conn.close()
"""


def test_a_name_taken_over_by_another_user_after_the_source_left_hands_the_target_nothing() -> None:
    """The record outlives its source for a ttl, and anyone who can read it learns the socket's name: another
    user binds it and offers handles of its own memory. The target checks the socket's owner and refuses."""
    intruder = intruder_or_skip()
    server = ipc_handoff.HandoffServer({"worker": WORKER, "allocations": allocations()})
    address = server.address
    server.close()
    fake = allocations(1)
    code = textwrap.dedent(IMPOSTOR.format(address=address, worker=WORKER, fake=fake))
    impostor = subprocess.Popen([intruder_python(), "-c", code], user=intruder.uid, group=intruder.gid, extra_groups=[],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                                env={"PATH": "/usr/bin:/bin"})
    try:
        assert impostor.stdout.readline().strip() == "ready", impostor.stderr.read()
        with pytest.raises(ipc_handoff.HandoffError, match=f"held by uid {intruder.uid}"):
            ipc_handoff.fetch(address, pid=os.getpid(), worker=WORKER)
    finally:
        impostor.kill()
        impostor.wait(30)


def intruder_python() -> str:
    from tests.helpers.second_user import SYSTEM_PYTHON

    return SYSTEM_PYTHON


class StubAgent:
    """What serve() asks of the NIXL agent (no NIXL here: the handoff is what is under test)."""

    name = WORKER
    registrations = 0

    def register(self, regions) -> float:
        return 0.0

    def metadata(self) -> bytes:
        return b"nixl-metadata"


def test_a_served_gpu_source_publishes_the_socket_not_the_handles_and_stops_handing_out_with_its_record(
        tmp_path, monkeypatch) -> None:
    """p2p_source.serve as a GPU source: its record (the file another reader of the registry sees) holds no handle byte
    and only the socket's name; a process of this uid gets the handles from the socket; once the publication is
    withdrawn (`peers --verify` found its bytes changed, or it stopped) the socket hands out nothing."""
    weights = torch.arange(256, dtype=torch.float32)
    driver = FakeDriver()
    driver.alloc(weights.data_ptr(), bytes(weights.numel() * 4))
    monkeypatch.setattr(cuda_ipc, "Driver", lambda: driver)
    monkeypatch.setattr(p2p_agent, "agent", lambda: StubAgent())
    monkeypatch.setattr(p2p_agent, "_regions", [])
    monkeypatch.setattr(p2p_source, "regions_for", lambda tensors: [Region(weights.data_ptr(), 1024, 0, "cuda")])
    registry = FileRegistry(tmp_path)
    publication = p2p_source.serve([("w", weights)], registry=registry, source_id="src", rank=0, world=1,
                            layout="processed", run_id="run-1")
    try:
        handle = next(iter(driver.handles))
        files = [p for p in tmp_path.rglob("*") if p.is_file()]
        assert files and not any(handle in p.read_bytes() or base64.b64encode(handle) in p.read_bytes() for p in files)
        (entry,) = registry.sources("src", 0)
        extra = entry.record.extra
        assert set(extra[p2p_source.HANDOFF]) == {"socket", "allocations"} and "cuda_ipc" not in extra
        got = fetch_in_child(entry.record.extra[p2p_source.HANDOFF]["socket"], entry.record.pid)
        assert [base64.b64decode(a["handle"]) for a in got["allocations"]] == [handle]
        publication.unpublish()
        assert "error" in fetch_in_child(entry.record.extra[p2p_source.HANDOFF]["socket"], entry.record.pid)
    finally:
        p2p_source._unpublish_all()
        p2p_source._serving.clear()
    assert not p2p_source._handoffs


def test_a_record_carrying_handles_is_not_published_and_a_foreign_socket_name_makes_it_invalid(tmp_path) -> None:
    registry = FileRegistry(tmp_path)
    tensors = [{"name": "w", "dtype": "float32", "shape": [4], "bytes": 16, "addr": 4096, "dev": 0}]

    def rec(extra: dict):
        return local_record("src", 0, 1, layout="processed", worker=WORKER, run_id="run-1", device="cuda",
                            agent_metadata=b"m", tensors=tensors, extra=extra)

    with pytest.raises(UsageError, match="carries CUDA IPC handles"):
        registry.publish(rec({"cuda_ipc": allocations()}))
    ok = {"socket": f"@mxlaunch-ipc-{os.getuid()}-{os.getpid()}-{'ab' * 16}", "allocations": 2}
    assert type(rec({}).from_json(rec({p2p_source.HANDOFF: ok}).to_json())).__name__ == "SourceRecord"
    for bad in ({**ok, "socket": "/tmp/planted.sock"}, {**ok, "allocations": 0}, {**ok, "handles": allocations()}):
        assert rec({}).from_json(rec({p2p_source.HANDOFF: bad}).to_json()) is None
    assert not registry.sources("src", 0)


@pytest.mark.parametrize("case", ["handles in the record", "socket of another process"])
def test_a_target_uses_no_handle_from_a_record_nor_from_a_socket_that_is_not_the_source(case: str, monkeypatch) -> None:
    """An older mxlaunch's record with handles in it, or a record whose socket is held by another process than
    the record's: nothing is opened, the same source is pulled over NIXL, and the line says why."""
    import types

    from mxlaunch.transfer.tensor_set import Pair

    opened: list = []
    monkeypatch.setattr(cuda_ipc, "pull", lambda *a, **k: opened.append(a))
    pairs = [Pair("w", 0x50000, 0x1000, 64, 0, 0, "cuda", "cuda")]
    with ipc_handoff.HandoffServer({"worker": WORKER, "allocations": allocations()}).start() as server:
        extra = ({"cuda_ipc": allocations()} if case == "handles in the record"
                 else {p2p_source.HANDOFF: {"socket": server.address, "allocations": 2}})
        rec = types.SimpleNamespace(extra=extra, boot_id=p2p.boot_id(), worker=WORKER, host="node-a",
                                    pid=os.getpid() + 1)
        skipped: list[str] = []
        assert p2p._ipc_pull(rec, pairs, skipped) is None and not opened
    why = "wrote them into its record" if case == "handles in the record" else "not the source"
    assert len(skipped) == 1 and why in skipped[0] and skipped[0].endswith("(pulled over NIXL instead)")


def test_bytes_pulled_through_the_handoff_are_checked_and_a_changed_source_is_never_served(tmp_path,
                                                                                          monkeypatch) -> None:
    """The whole same-host path: p2p_source.serve publishes the socket, p2p.pull fetches the handles from it and copies
    (host memory and memmove stand in for the driver's mapping and copies), then checks every checksum. A
    source whose memory was written after it published (what a holder of a handle could do) is refused with
    bytes landed: the target rebuilds, never serves."""
    import ctypes
    import types

    weights = torch.arange(256, dtype=torch.float32)
    driver = FakeDriver()
    driver.alloc(weights.data_ptr(), bytes(weights.numel() * 4))
    monkeypatch.setattr(cuda_ipc, "Driver", lambda: driver)
    monkeypatch.setattr(p2p_agent, "agent", lambda: StubAgent())
    monkeypatch.setattr(p2p_agent, "_regions", [])
    monkeypatch.setattr(p2p_source, "regions_for", lambda tensors: [Region(weights.data_ptr(), 1024, 0, "cuda")])
    monkeypatch.setattr(cuda_ipc, "split", lambda pairs: (list(pairs), []))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=0))
    handed: list = []

    def copy(allocations, pairs, stream):
        handed.append([base64.b64decode(a["handle"]) for a in allocations])
        for p in pairs:
            ctypes.memmove(p.local_addr, p.remote_addr, p.bytes)
        return cuda_ipc.IpcStats(sum(p.bytes for p in pairs), 0.0, 0.0, len(allocations))

    monkeypatch.setattr(cuda_ipc, "pull", copy)
    registry = FileRegistry(tmp_path)
    p2p_source.serve([("w", weights)], registry=registry, source_id="src", rank=0, world=1, layout="processed",
              run_id="run-1")
    try:
        mine = torch.zeros_like(weights)
        result = p2p.pull([("w", mine)], registry=registry, source_id="src", rank=0, world=1, layout="processed")
        assert result.transport == "CUDA IPC" and torch.equal(mine, weights) and handed == [list(driver.handles)]
        weights[7] = -1.0  # written after it published its checksums
        with pytest.raises(p2p.RestoreError, match="differ from the checksums") as refused:
            p2p.pull([("w", torch.zeros_like(weights))], registry=registry, source_id="src", rank=0, world=1,
                     layout="processed")
        assert refused.value.landed is True
    finally:
        p2p_source._unpublish_all()
        p2p_source._serving.clear()
