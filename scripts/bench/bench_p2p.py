"""P2P weights GPU to GPU over NIXL, through the plugin core's `p2p` strategy, exact (issue 12).

Two processes, one per GPU. The source builds a transformers Llama from a config (≥ 8 GiB bf16, random
weights), runs a post-processing that packs each MLP's gate and up weights into one tensor attached as a
plain attribute (like the engines' qkv/gate_up packing), computes gold logits, and publishes itself
through the file registry (plugin/p2p_source.serve: registration by allocation). Each target run is a fresh
process that loads the way an engine adapter does (load_step.build_and_load + RankLoad, strategy p2p,
processed layout): NIXL agent started while the model is built, post-processing on placeholder values,
then the pull of every tensor the model holds; logits compared with `torch.equal`. In the same target
process: the torch peer copy of the same bytes (the baseline) and registration per tensor vs per
allocation. Writes JSON.

    python scripts/bench/bench_p2p.py --out p2p.json                 # 2 GPUs: cuda:0 serves, cuda:1 pulls
    python scripts/bench/bench_p2p.py --devices cpu,cpu --layers 2 --hidden 256 --inter 512 --out smoke.json

--knob-sweep: one source, then one fresh target process per setting of KNOBS (NIXL/UCX settings are read
when the agent and its UCX context start, so each needs its own process; the source keeps the defaults:
every knob here acts in the process that posts the READs). Each target pulls 1 + --reps times, each
timed pull into zeroed weights and checked exact (logits `torch.equal` to the source's); the first
target also measures the torch baselines. A time budget (--budget-s) stops starting new targets.

    python scripts/bench/bench_p2p.py --knob-sweep --out knobs.json                     # ~5 min on 2×H200 (≤ 7.5)
    python scripts/bench/bench_p2p.py --knob-sweep --knobs default,threads4 --out k.json  # a subset

--ranks N (issue 16): N/2 sources on GPUs 0..N/2-1 (rank r of a world of N/2, its own weights), N/2
targets on GPUs N/2..N-1, target r pulling rank r from GPU r — all targets released by one barrier after
their post-processing, so every pair moves at once. Aggregate GiB/s = all bytes / (last pull end − first
pull start), against N/2 concurrent torch peer copies (same pairs, same bytes, one barrier) in the same
targets. Each pair's model is a whole small Llama (not a TP shard): the transfer pattern is the node's.

    python scripts/bench/bench_p2p.py --ranks 8 --out p2p_ranks8.json               # 8 GPUs: 4 pull from 4
    python scripts/bench/bench_p2p.py --ranks 2 --devices cpu,cpu --layers 2 --hidden 256 --inter 512 --out s.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GiB = 1 << 30
SOURCE_ID = "benchp2p0123456789"
log = logging.getLogger("bench_p2p")


def config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_hidden_layers=args.layers,
                       num_attention_heads=max(1, args.hidden // 128), num_key_value_heads=max(1, args.hidden // 512),
                       vocab_size=32000, max_position_embeddings=2048)


def build(args: argparse.Namespace, device: str, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config(args), dtype=torch.bfloat16)
    return model.eval()


def packed_mlp_forward(self, x):
    import torch.nn.functional as F

    gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def post_process(model) -> None:
    """Pack gate_proj and up_proj into one `gate_up` tensor (a plain attribute); drop the originals."""
    import torch

    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.gate_up = torch.cat([mlp.gate_proj.weight.data, mlp.up_proj.weight.data]).contiguous()
        del mlp.gate_proj, mlp.up_proj
        mlp.forward = types.MethodType(packed_mlp_forward, mlp)


def logits(model, device: str):
    import torch

    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        return model(ids).logits.float()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# ---- source --------------------------------------------------------------------------------------------


def gold_name(args: argparse.Namespace) -> str:
    return "gold.pt" if args.world == 1 else f"gold-{args.rank}.pt"


def source_name(rank: int, world: int) -> str:
    return "source.json" if world == 1 else f"source-{rank}.json"


def file_barrier(work: Path, name: str, rank: int, parties: int, timeout_s: float = 300.0) -> float:
    """Every party touches `name-<rank>` and waits for all `parties` of them; returns time.time() at release.
    (Processes started by one parent with no shared multiprocessing context: a folder is the meeting point.)"""
    (work / f"{name}-{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(work.glob(f"{name}-*"))) < parties:
        if time.monotonic() > deadline:
            raise SystemExit(f"barrier {name}: only {len(list(work.glob(f'{name}-*')))} of {parties} arrived")
        time.sleep(0.001)
    return time.time()


def run_source(args: argparse.Namespace) -> None:
    import torch

    from mxlaunch.coord.peers import open_registry
    from mxlaunch.plugin import p2p_agent, p2p_source
    from mxlaunch.transfer.tensor_set import processed_tensors

    device = args.device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    model = build(args, device, seed=args.rank)
    post_process(model)
    gold = logits(model, device).cpu()
    torch.save(gold, Path(args.work) / gold_name(args))
    named = processed_tensors(model)
    started = time.perf_counter()
    pub = p2p_source.serve(named, registry=open_registry(f"file:{args.work}/reg", None), source_id=SOURCE_ID, rank=args.rank,
                    world=args.world, layout="processed", run_id=f"bench-source-{args.rank}", ttl_s=60)
    info = {"serve_seconds": time.perf_counter() - started, "agent_start_seconds": p2p_agent.agent().start_seconds,
            **pub.record.extra, "tensors": len(pub.record.tensors), "rank": args.rank, "device": device}
    (Path(args.work) / source_name(args.rank, args.world)).write_text(json.dumps(info))
    stop = Path(args.work) / "stop"
    while not stop.exists():
        time.sleep(0.2)
    pub.unpublish()


# ---- target --------------------------------------------------------------------------------------------


class BenchEngine:
    """An engine adapter in miniature: build (placeholders), weight step by the plan, post-process."""

    def __init__(self, args: argparse.Namespace, plan) -> None:
        self.args, self.plan = args, plan
        self._outcome = self._rank_load = None
        self._force_default = False
        self.build_seconds = 0.0
        self.finish_started = 0.0
        self.pull_wall_start = 0.0

    def build(self):
        from mxlaunch.plugin.load_step import effective_plan
        from mxlaunch.plugin.rank_load import RankLoad

        t0 = time.perf_counter()
        model = build(self.args, self.args.device, seed=1)
        sync(self.args.device)
        self.build_seconds = time.perf_counter() - t0

        def default_load() -> None:
            raise RuntimeError("the benchmark has no checkpoint: the default loader must not run")

        self._rank_load = RankLoad(model, effective_plan(self, self.plan), self.args.rank, default_load, engine="bench",
                                   log=log)
        self._outcome = self._rank_load.run()
        post_process(model)
        sync(self.args.device)
        if self.args.barrier:  # --ranks: every target starts its pull at once
            self.pull_wall_start = file_barrier(Path(self.args.work), self.args.barrier, self.args.rank, self.args.world)
        self.finish_started = time.perf_counter()
        return model


def peer_copy(nbytes: int, src: str, dst: str, reps: int = 5, on: str | None = None) -> list[float]:
    """b (on dst) ← a (on src), timed; `on` names the device whose stream runs it (None: torch's choice)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    out = []
    for _ in range(reps):
        sync(src), sync(dst)
        t0 = time.perf_counter()
        if on is None:
            b.copy_(a, non_blocking=True)
        else:
            with torch.cuda.device(on):
                b.copy_(a, non_blocking=True)
        sync(src), sync(dst)
        out.append(nbytes / GiB / (time.perf_counter() - t0))
    del a, b
    return out


def concurrent_peer_copy(args: argparse.Namespace, nbytes: int, reps: int = 3) -> list[list[float]]:
    """The --ranks baseline: this pair's torch peer copy of the pull's bytes (source GPU → this GPU), every
    pair released by one barrier per repetition: [(start, end)] wall times."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=args.source_device)
    b = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    spans = []
    for i in range(reps + 1):  # the first is a warm-up (peer access set up, allocator)
        sync(args.source_device), sync(args.device)
        t0 = file_barrier(Path(args.work), f"{args.barrier}-peer{i}", args.rank, args.world)
        b.copy_(a, non_blocking=True)
        sync(args.source_device), sync(args.device)
        if i:
            spans.append([t0, time.time()])
    del a, b
    return spans


def registration_strategies(named) -> dict:
    """Register the same tensors per tensor and per allocation (fresh agents), time each."""
    from mxlaunch.plugin.tensors import group_tensors
    from mxlaunch.transfer.nixl import Agent
    from mxlaunch.transfer.regions import Region, regions_for

    tensors = [g.tensor for g in group_tensors(named) if g.tensor.numel()]
    out = {}
    per_tensor = [Region(t.data_ptr(), t.numel() * t.element_size(), t.device.index or 0, t.device.type) for t in tensors]
    for name, regions in (("per_tensor", per_tensor), ("per_allocation", regions_for(tensors))):
        agent = Agent(f"bench-reg-{name}-{os.getpid()}")
        took = agent.register(regions)
        agent.close()
        out[name] = {"registrations": len(regions), "seconds": round(took, 4)}
    return out


SWEEP = [(0, 1), (0, 2), (0, 4), (64 << 20, 1), (64 << 20, 4), (16 << 20, 8), (256 << 20, 8)]


def sweep(args: argparse.Namespace, named, nbytes: int) -> list[dict]:
    """Pull the same bytes again (same agent, source already mapped) with other descriptor shapes:
    spans cut into chunks, several READ requests in flight."""
    import base64

    from mxlaunch.coord.peers import open_registry
    from mxlaunch.plugin import p2p_agent
    from mxlaunch.transfer.tensor_set import match

    rec = [e for e in open_registry(f"file:{args.work}/reg", None).sources(SOURCE_ID, 0)
           if e.record.run_id == "bench-source"][0].record
    pairs = match(named, rec.tensors)
    meta = base64.b64decode(rec.agent_metadata)
    out = []
    for chunk, inflight in SWEEP:
        rates = []
        for _ in range(3):
            stats = p2p_agent.agent().pull(meta, pairs, chunk_bytes=chunk, inflight=inflight)
            rates.append(nbytes / GiB / stats.transfer_seconds)
        out.append({"chunk_mib": chunk >> 20, "inflight": inflight, "gibps": rates,
                    "median": statistics.median(rates), "descriptors": stats.descriptors})
        print(json.dumps(out[-1]), flush=True)
    # the push direction: the same spans written from this GPU into the source's (identical bytes)
    rates = [nbytes / GiB / p2p_agent.agent().pull(meta, pairs, op="WRITE").transfer_seconds for _ in range(3)]
    out.append({"op": "WRITE", "gibps": rates, "median": statistics.median(rates)})
    print(json.dumps(out[-1]), flush=True)
    # time = fixed + bytes / rate: pulls of growing prefixes of the same spans
    fit = []
    total = sum(p.bytes for p in pairs)
    for share in (0.0, 0.125, 0.25, 0.5, 1.0):
        some, acc = [], 0
        for p in pairs:
            if acc >= share * total and some:
                break
            some.append(p)
            acc += p.bytes
        if not share:
            some = [some[0].__class__("one", some[0].local_addr, some[0].remote_addr, min(4096, some[0].bytes),
                                      some[0].local_dev, some[0].remote_dev, some[0].local_kind, some[0].remote_kind)]
        secs = sorted(p2p_agent.agent().pull(meta, some).transfer_seconds for _ in range(5))
        fit.append({"bytes": sum(p.bytes for p in some), "descriptors": len(some), "seconds_median": secs[2]})
        print(json.dumps(fit[-1]), flush=True)
    return {"shapes": out, "fit": fit}


def torch_copy_per_tensor(named, src: str, reps: int = 3) -> list[float]:
    """The same tensors copied one by one from copies on the source GPU (torch, one stream)."""
    import torch

    from mxlaunch.plugin.tensors import group_tensors

    dst = [g.tensor for g in group_tensors(named) if g.tensor.numel() and g.tensor.is_contiguous()]
    srcs = [torch.empty_like(t, device=src) for t in dst]
    nbytes = sum(t.numel() * t.element_size() for t in dst)
    out = []
    saved = [t.clone() for t in dst]
    for _ in range(reps):
        sync(src), sync(str(dst[0].device))
        t0 = time.perf_counter()
        for d, s_ in zip(dst, srcs):
            d.copy_(s_, non_blocking=True)
        sync(src), sync(str(dst[0].device))
        out.append(nbytes / GiB / (time.perf_counter() - t0))
    for d, s_ in zip(dst, saved):
        d.copy_(s_)
    return out


def run_target(args: argparse.Namespace) -> None:
    import torch

    from mxlaunch.plan import Plan
    from mxlaunch.plugin.load_step import build_and_load
    from mxlaunch.transfer.tensor_set import processed_tensors

    device = args.device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    run_dir = Path(args.work) / f"run-{os.getpid()}"
    plan = Plan(strategy="p2p", source_id=SOURCE_ID, run_dir=str(run_dir), fallback_ok=False,
                p2p={"registry": f"file:{args.work}/reg", "layout": "processed", "world": args.world,
                     "run_id": f"bench-target-{os.getpid()}", "serve": not args.barrier, "timeout_s": 120})
    engine = BenchEngine(args, plan)
    t0 = time.perf_counter()
    model = build_and_load(engine, engine.build, plan=plan, rank=args.rank, log=log, engine="bench")
    sync(device)
    done, done_wall = time.perf_counter(), time.time()
    loaded = json.loads((run_dir / "markers" / f"loaded-{args.rank}.json").read_text())
    gold = torch.load(Path(args.work) / gold_name(args))
    mine = logits(model, device).cpu()
    named = processed_tensors(model)
    nbytes = loaded["bytes"]
    row = {
        "bytes": nbytes, "gib": nbytes / GiB, "tensors": loaded["tensors"],
        "build_seconds": round(engine.build_seconds, 3),
        "p2p_phase_seconds": round(done - engine.finish_started, 4),  # after post-processing → weights final (+ serve)
        "pull_seconds": loaded["seconds"], "transfer_seconds": loaded["transfer_seconds"],
        "register_seconds": loaded["register_seconds"], "registrations": loaded["registrations"],
        "transfer_gibps": nbytes / GiB / loaded["transfer_seconds"], "pull_gibps": nbytes / GiB / loaded["seconds"],
        "logits_equal": bool(torch.equal(gold, mine)), "total_seconds": round(done - t0, 3),
        "pull_phases": loaded.get("phases", {}), "prepared_during_build": loaded.get("prepared", {}),
        "rank": args.rank, "device": device, "pull_span": [engine.pull_wall_start, done_wall],
    }
    if args.barrier:  # --ranks: the concurrent baseline, then nothing else (the others are timing too)
        if device.startswith("cuda"):
            row["peer_copy_spans"] = concurrent_peer_copy(args, nbytes)
        row["logits_equal_at_end"] = bool(torch.equal(gold, logits(model, device).cpu()))
        Path(args.out).write_text(json.dumps(row))
        return
    if args.sweep:
        row["sweep"] = sweep(args, named, nbytes)
        row["logits_equal_after_sweep"] = bool(torch.equal(gold, logits(model, device).cpu()))
    src = args.source_device
    row["peer_copy_gibps"] = peer_copy(nbytes, src, device) if device.startswith("cuda") else []
    if device.startswith("cuda") and args.sweep:
        row["peer_copy_on_source_stream_gibps"] = peer_copy(nbytes, src, device, on=src)
        row["peer_copy_on_target_stream_gibps"] = peer_copy(nbytes, src, device, on=device)
    if device.startswith("cuda"):
        row["torch_copy_per_tensor_gibps"] = torch_copy_per_tensor(named, src)
        row["logits_equal_at_end"] = bool(torch.equal(gold, logits(model, device).cpu()))
    row["registration"] = registration_strategies(named)
    Path(args.out).write_text(json.dumps(row))


# ---- knob sweep ----------------------------------------------------------------------------------------

UCX_PARAMS, PULL, PROGRESS = "MXLAUNCH_NIXL_UCX_PARAMS", "MXLAUNCH_NIXL_PULL", "MXLAUNCH_NIXL_PROGRESS_THREAD"
THREADS = "num_threads={},split_batch_size=1"  # split_batch_size=1: NIXL splits even a short list over the threads
# (label, environment of the target, op, why) — the reference first, then by expected effect (docs/p2p.md)
KNOBS: list[tuple[str, dict, str, str]] = [
    ("default", {"UCX_PROTO_INFO": "*get*"}, "READ",
     "reference: NIXL's and UCX's defaults; UCX prints the GET protocol and lanes it selects"),
    ("threads4", {UCX_PARAMS: THREADS.format(4), PULL: "chunk_mib=64,batch_mib=0"}, "READ",
     "UCX backend thread pool: one request split over 4 dedicated UCX workers = 4 CUDA streams to the peer"),
    ("threads8", {UCX_PARAMS: THREADS.format(8), PULL: "chunk_mib=32,batch_mib=0"}, "READ",
     "the same with 8 workers/streams"),
    ("rails1", {"UCX_MAX_RMA_RAILS": "1"}, "READ",
     "NIXL sets UCX_MAX_RMA_RAILS=2: a GET may be split with a second RMA lane (e.g. an IB NIC); 1 lane only"),
    ("tls_nvlink", {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,sm,self"}, "READ",
     "no InfiniBand transports: CUDA IPC for GPU memory (tcp stays: NIXL's peer error handling needs an AM lane "
     "with a peer failure handler, which shared memory lacks)"),
    ("tls_ipc_info", {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,sm,self", "UCX_PROTO_INFO": "*get*"}, "READ",
     "tls_nvlink with UCX's protocol choice printed (two processes on one GPU: does cuda_ipc serve the GET?)"),
    ("threads2", {UCX_PARAMS: THREADS.format(2), PULL: "chunk_mib=64,batch_mib=0"}, "READ",
     "thread pool with 2 workers/streams"),
    ("one_request_chunk64", {PULL: "chunk_mib=64,batch_mib=0"}, "READ",
     "control for threadsN: the same 64 MiB descriptors in one request on one worker/stream"),
    ("no_progress_thread", {PROGRESS: "0"}, "READ",
     "agent without NIXL's progress thread (which spins on the UCX worker the READs are posted on)"),
    ("prepped", {PULL: "prepped=1"}, "READ",
     "descriptor lists prepared once (prep_xfer_dlist), requests by index (make_prepped_xfer)"),
    ("threads4_prepped", {UCX_PARAMS: THREADS.format(4), PULL: "prepped=1,merge=0,chunk_mib=64,batch_mib=0"}, "READ",
     "threads4 through the prepared lists (merge=0 keeps the 64 MiB pieces apart)"),
    ("proto_v1", {"UCX_PROTO_ENABLE": "n"}, "READ", "UCX's older protocol selection"),
    ("sgl_write", {"NIXL_UCX_SGL_ENABLE": "1"}, "WRITE",
     "diagnostic, not a pull: WRITE as one scatter-gather request (one cuMemcpyBatchAsync where UCX has it)"),
]
KNOB_VARS = sorted({k for _, env, _, _ in KNOBS for k in env} | {UCX_PARAMS, PULL, PROGRESS})


def cudart_copy(nbytes: int, src: str, dst: str, on: str, reps: int = 5) -> list[float]:
    """cudaMemcpyAsync of `nbytes` from `src` to `dst` issued on a stream of `on` (torch's own peer copy
    always runs on the source GPU's stream; NIXL's READ and WRITE run on the target's), via ctypes."""
    import ctypes

    import torch

    path = next((line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line), None)
    if path is None:
        raise RuntimeError("libcudart is not loaded in this process")
    rt = ctypes.CDLL(path)
    rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    other = dst if on == src else src
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    with torch.cuda.device(on):
        rt.cudaSetDevice(torch.device(on).index)  # the library found may not be the copy torch set the device in
        rt.cudaDeviceEnablePeerAccess(torch.device(other).index, 0)  # 704: already enabled
        rt.cudaGetLastError()
        stream = torch.cuda.Stream()
        out = []
        for _ in range(reps):
            sync(src), sync(dst)
            t0 = time.perf_counter()
            rc = rt.cudaMemcpyAsync(b.data_ptr(), a.data_ptr(), nbytes, 4, stream.cuda_stream)  # 4: cudaMemcpyDefault
            stream.synchronize()
            if rc:
                raise RuntimeError(f"cudaMemcpyAsync returned {rc}")
            out.append(nbytes / GiB / (time.perf_counter() - t0))
    del a, b
    return out


def ucx_version() -> str:
    import ctypes

    path = next((line.split()[-1] for line in open("/proc/self/maps") if "libucp" in line), None)
    if path is None:
        return ""
    lib = ctypes.CDLL(path)
    lib.ucp_get_version_string.restype = ctypes.c_char_p
    return lib.ucp_get_version_string().decode()


def run_knob(args: argparse.Namespace) -> None:
    """One setting: build the target model (other values), pull 1 + reps times, each into zeroed weights and
    checked exact; WRITE rows (the push diagnostic) are checked by a plain READ back afterwards."""
    import base64
    import dataclasses

    import torch

    from mxlaunch.coord.peers import open_registry
    from mxlaunch.plugin import p2p_agent
    from mxlaunch.plugin.tensors import group_tensors
    from mxlaunch.transfer import nixl_batches
    from mxlaunch.transfer.regions import regions_for
    from mxlaunch.transfer.tensor_set import match, processed_tensors

    started = time.perf_counter()
    device, op = args.device, args.op
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    model = build(args, device, seed=1)
    post_process(model)
    sync(device)
    named = processed_tensors(model)
    gold = torch.load(Path(args.work) / "gold.pt")
    rec = [e for e in open_registry(f"file:{args.work}/reg", None).sources(SOURCE_ID, 0)
           if e.record.run_id == "bench-source"][0].record
    pairs = match(named, rec.tensors)
    meta = base64.b64decode(rec.agent_metadata)
    agent = p2p_agent.agent()  # MXLAUNCH_NIXL_* of this process apply
    register_s = agent.register(regions_for([t for _, t in named]))
    nbytes = sum(p.bytes for p in pairs)
    whole = [g.tensor for g in group_tensors(named) if g.tensor.numel()]

    def scribble() -> None:
        for t in whole:
            t.zero_()
        sync(device)

    def exact() -> bool:
        return bool(torch.equal(gold, logits(model, device).cpu()))

    row: dict = {"label": args.label, "op": op, "ucx_params": agent.ucx_params,
                 "pull_config": dataclasses.asdict(agent.pull_config), "progress_thread": agent.progress_thread,
                 "agent_start_seconds": round(agent.start_seconds, 3), "register_seconds": round(register_s, 4),
                 "bytes": nbytes, "gib": nbytes / GiB, "pairs": len(pairs), "ucx_version": ucx_version()}
    scribble()
    warm = agent.pull(meta, pairs)  # maps the source's allocations; UCX selects its protocols
    row["warm"] = {"gibps": nbytes / GiB / warm.transfer_seconds, "exact": exact(), "descriptors": warm.descriptors,
                   "requests": warm.batches}
    rates, exacts = [], []
    for _ in range(args.reps):
        if op == "READ":
            scribble()
        stats = agent.pull(meta, pairs, op=op)
        rates.append(nbytes / GiB / stats.transfer_seconds)
        if op != "READ":  # the bytes written to the source must be the gold ones: read them back
            scribble()
            agent.pull(meta, pairs, prepped=False, chunk_bytes=0, inflight=1, batch_bytes=nixl_batches.BATCH_BYTES)
        exacts.append(exact())
    row.update(gibps=rates, median=statistics.median(rates), exact=exacts, all_exact=all(exacts) and row["warm"]["exact"],
               descriptors=stats.descriptors, requests=stats.batches, prepped=stats.prepped)
    print(json.dumps({k: row[k] for k in ("label", "median", "all_exact", "requests")}), flush=True)
    if args.baselines and device.startswith("cuda"):
        src = args.source_device
        base: dict = {"peer_copy_gibps": peer_copy(nbytes, src, device),  # torch: runs on the source's stream
                      "torch_copy_per_tensor_gibps": torch_copy_per_tensor(named, src)}
        for name, (a, b) in {"cudart_pull_on_target_gibps": (src, device),
                             "cudart_push_on_target_gibps": (device, src),
                             "cudart_push_on_source_gibps": (src, device)}.items():
            try:
                base[name] = cudart_copy(nbytes, a, b, on=device if "on_target" in name else src)
            except Exception as exc:  # noqa: BLE001 - a baseline, not the sweep
                base[name] = f"failed: {exc}"
        row["baselines"] = base
        row["exact_after_baselines"] = exact()
    row["child_seconds"] = round(time.perf_counter() - started, 1)
    Path(args.out).write_text(json.dumps(row))


def machine_info() -> dict:
    """What the result depends on, without starting CUDA in this process (the children own the GPUs)."""
    import importlib.metadata as md

    info: dict = {"packages": {d: md.version(d) for d in ("torch", "nixl", "nixl-cu13", "nixl-cu12") if _has_dist(md, d)}}
    ib = Path("/sys/class/infiniband")
    info["infiniband"] = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []  # a second RMA lane?
    for key, cmd in (("gpus", ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]),
                     ("nvidia_smi_topo", ["nvidia-smi", "topo", "-m"])):
        try:
            info[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout[-3000:]
        except Exception:  # noqa: BLE001
            info[key] = ""
    info["env"] = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "MXLAUNCH_NIXL_"))}
    return info


def _has_dist(md, name: str) -> bool:
    try:
        md.version(name)
        return True
    except Exception:  # noqa: BLE001
        return False


def stop_sources(work: Path, sources: list[subprocess.Popen]) -> None:
    """Ask the source children to unpublish and exit (the stop file), killing any that do not in 60 s."""
    (work / "stop").touch()
    for source in sources:
        try:
            source.wait(timeout=60)
        except subprocess.TimeoutExpired:
            source.kill()


def wait_for_source(source: subprocess.Popen, work: Path, timeout_s: float = 600, name: str = "source.json") -> dict:
    """The source child's report, once it serves (SystemExit if it died or took longer than timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while not (work / name).exists():
        if source.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the source did not start")
        time.sleep(0.5)
    return json.loads((work / name).read_text())


def knob_sweep(args: argparse.Namespace) -> None:
    began = time.monotonic()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src_dev, dst_dev = args.devices.split(",")
    base_env = {k: v for k, v in os.environ.items() if k not in KNOB_VARS}  # the source and every target start clean
    wanted = args.knobs.split(",") if args.knobs else [k[0] for k in KNOBS]
    unknown = [w for w in wanted if w not in {k[0] for k in KNOBS}]
    if unknown:
        raise SystemExit(f"unknown knob setting(s) {unknown}: choose from {[k[0] for k in KNOBS]}")
    plan = [k for k in KNOBS if k[0] in wanted]
    res: dict = {"date": time.strftime("%Y-%m-%d"), "devices": args.devices, "machine": machine_info(), "settings": []}
    source = subprocess.Popen(child("source", args, src_dev), env=base_env)
    try:
        res["source"] = wait_for_source(source, work)
        res["source_seconds"] = round(time.monotonic() - began, 1)
        longest = 60.0
        runs = [(i, k) for i, k in enumerate(plan)]
        if "default" in wanted:
            runs.append((len(plan), ("default_again", plan[0][1] if plan[0][0] == "default" else {}, "READ",
                                     "the reference again, after the others (drift), if the budget allows")))
        for i, (label, env, op, why) in runs:
            left = args.budget_s - (time.monotonic() - began)
            entry: dict = {"label": label, "env": env, "why": why}
            if left < longest * 1.2:
                entry["skipped"] = f"time budget ({args.budget_s} s) spent"
                res["settings"].append(entry)
                continue
            out, log_path = work / f"knob-{i}.json", work / f"knob-{i}.log"
            cmd = child("knob", args, dst_dev, str(out)) + ["--label", label, "--op", op, "--reps", str(args.reps)]
            if i == 0 or label == "default_again":
                cmd.append("--baselines")
            t0 = time.monotonic()
            with open(log_path, "w") as log_file:
                try:
                    rc = subprocess.run(cmd, env={**base_env, **env}, stdout=log_file, stderr=subprocess.STDOUT,
                                        timeout=min(args.child_timeout_s, max(30.0, left))).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            took = time.monotonic() - t0
            longest = max(longest if i else 0.0, took)
            log = log_path.read_text(errors="replace").splitlines()
            if rc == 0 and out.exists():
                entry.update(json.loads(out.read_text()))
            else:
                entry["failed"] = f"exit {rc}"
                entry["log_tail"] = log[-40:]
            if env.get("UCX_PROTO_INFO"):
                entry["ucx_proto_info"] = [line for line in log if "|" in line][:150]
            entry["wall_seconds"] = round(took, 1)
            res["settings"].append(entry)
            print(json.dumps({k: entry.get(k) for k in ("label", "median", "all_exact", "failed", "wall_seconds")}),
                  flush=True)
    finally:
        stop_sources(work, [source])
    base = next((e.get("baselines") for e in res["settings"] if e.get("baselines")), None)
    peer = statistics.median(base["peer_copy_gibps"]) if base else None
    res["peer_copy_gibps_median"] = peer
    res["summary"] = [{"label": e["label"], "median_gibps": round(e["median"], 1) if "median" in e else None,
                       "ratio_vs_peer_copy": round(e["median"] / peer, 3) if peer and "median" in e else None,
                       "all_exact": e.get("all_exact"), "note": e.get("failed") or e.get("skipped")}
                      for e in res["settings"]]
    res["total_seconds"] = round(time.monotonic() - began, 1)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({"peer_copy_gibps_median": peer, "summary": res["summary"],
                      "total_seconds": res["total_seconds"]}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


# ---- N ranks at once -----------------------------------------------------------------------------------


def ranks_run(args: argparse.Namespace) -> None:
    n = args.ranks
    if n < 2 or n % 2:
        raise SystemExit(f"--ranks {n}: give an even number ≥ 2 (half the GPUs serve, half pull)")
    world = n // 2
    if args.devices.startswith("cpu"):
        devices = ["cpu"] * n
    else:  # counted without CUDA in this process (the children own the GPUs)
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        have = sum(1 for line in smi.stdout.splitlines() if line.startswith("GPU "))
        if have < n:
            raise SystemExit(f"--ranks {n}: this machine has {have} GPU(s) — ask for at most that")
        devices = [f"cuda:{i}" for i in range(n)]
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    base = ["--world", str(world)]
    sources = [subprocess.Popen(child("source", args, devices[r]) + base + ["--rank", str(r)]) for r in range(world)]
    res: dict = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "ranks": n, "pairs": world,
                 "devices": devices, "machine": machine_info(), "runs": []}
    try:
        res["sources"] = [wait_for_source(sources[r], work, name=source_name(r, world)) for r in range(world)]
        for i in range(args.runs):
            outs = [work / f"target-{i}-{r}.json" for r in range(world)]
            targets = [subprocess.Popen(child("target", args, devices[world + r], str(outs[r])) + base +
                                        ["--rank", str(r), "--source-device", devices[r], "--barrier", f"run{i}"])
                       for r in range(world)]
            codes = [t.wait(timeout=args.child_timeout_s * 4) for t in targets]
            if any(codes):
                raise SystemExit(f"run {i}: target exit codes {codes}")
            rows = [json.loads(o.read_text()) for o in outs]
            total = sum(r["bytes"] for r in rows)
            run = {"gib": total / GiB, "targets": rows,
                   "aggregate_gibps": total / GiB / (max(r["pull_span"][1] for r in rows) - min(r["pull_span"][0] for r in rows)),
                   "aggregate_transfer_gibps": total / GiB / max(r["transfer_seconds"] for r in rows),
                   "per_pair_transfer_gibps": [r["transfer_gibps"] for r in rows],
                   "logits_equal_all": all(r["logits_equal"] and r.get("logits_equal_at_end", True) for r in rows)}
            if rows[0].get("peer_copy_spans"):
                run["concurrent_peer_copy_gibps"] = [
                    total / GiB / (max(r["peer_copy_spans"][k][1] for r in rows) - min(r["peer_copy_spans"][k][0] for r in rows))
                    for k in range(len(rows[0]["peer_copy_spans"]))]
            res["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "targets"}), flush=True)
    finally:
        stop_sources(work, sources)
    runs = res["runs"]
    if runs:
        agg = statistics.median(r["aggregate_gibps"] for r in runs)
        peers = [x for r in runs for x in r.get("concurrent_peer_copy_gibps", [])]
        peer = statistics.median(peers) if peers else None
        res["summary"] = {"gib_total": runs[0]["gib"], "aggregate_gibps_median": agg,
                          "aggregate_transfer_gibps_median": statistics.median(r["aggregate_transfer_gibps"] for r in runs),
                          "concurrent_peer_copy_gibps_median": peer,
                          # the transfers (as bench_p2p's one-pair ratio), then the whole pull phase (+ per-pull setup)
                          "ratio_vs_concurrent_peer_copies": (statistics.median(r["aggregate_transfer_gibps"] for r in runs) / peer
                                                              if peer else None),
                          "ratio_phase_vs_concurrent_peer_copies": agg / peer if peer else None,
                          "per_pair_spread": [round(max(r["per_pair_transfer_gibps"]) / min(r["per_pair_transfer_gibps"]), 3)
                                              for r in runs],
                          "logits_equal_all": all(r["logits_equal_all"] for r in runs)}
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res.get("summary"), indent=2))
    shutil.rmtree(work, ignore_errors=True)


# ---- orchestration -------------------------------------------------------------------------------------


def child(role: str, args: argparse.Namespace, device: str, out: str = "") -> list[str]:
    cmd = [sys.executable, __file__, "--role", role, "--device", device, "--work", args.work, "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--inter", str(args.inter), "--source-device", args.devices.split(",")[0]]
    return cmd + (["--out", out] if out else []) + (["--sweep"] if args.sweep else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="p2p.json")
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="source,target")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--work", default="/dev/shm/mx-bench-p2p")
    ap.add_argument("--sweep", action="store_true", help="also re-pull with other descriptor shapes")
    ap.add_argument("--knob-sweep", action="store_true", help="one target process per NIXL/UCX setting (KNOBS)")
    ap.add_argument("--knobs", default="", help="--knob-sweep: only these settings (comma-separated labels)")
    ap.add_argument("--reps", type=int, default=3, help="--knob-sweep: timed pulls per setting (after a warm-up)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="--knob-sweep: start no target after this")
    ap.add_argument("--child-timeout-s", type=float, default=150.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--op", default="READ")
    ap.add_argument("--baselines", action="store_true")
    ap.add_argument("--role", default="")
    ap.add_argument("--device", default="")
    ap.add_argument("--source-device", default="")
    ap.add_argument("--ranks", type=int, default=0, help="N GPUs: N/2 sources, N/2 targets pulling at once")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--barrier", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.role == "source":
        return run_source(args)
    if args.role == "target":
        return run_target(args)
    if args.role == "knob":
        return run_knob(args)
    if args.knob_sweep:
        return knob_sweep(args)
    if args.ranks:
        return ranks_run(args)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src_dev, dst_dev = args.devices.split(",")
    source = subprocess.Popen(child("source", args, src_dev))
    res: dict = {"date": time.strftime("%Y-%m-%d"), "devices": args.devices, "runs": []}
    try:
        res["source"] = wait_for_source(source, work)
        for i in range(args.runs):
            out = work / f"target-{i}.json"
            subprocess.run(child("target", args, dst_dev, str(out)), check=True)
            res["runs"].append(json.loads(out.read_text()))
            print(json.dumps(res["runs"][-1]), flush=True)
    finally:
        stop_sources(work, [source])
    runs = res["runs"]
    if runs:
        med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        peer = statistics.median(x for r in runs for x in r["peer_copy_gibps"]) if runs[0]["peer_copy_gibps"] else None
        res["summary"] = {
            "gib": runs[0]["gib"], "transfer_gibps_median": med("transfer_gibps"), "pull_gibps_median": med("pull_gibps"),
            "peer_copy_gibps_median": peer, "ratio_vs_peer_copy": med("transfer_gibps") / peer if peer else None,
            "register_seconds_median": med("register_seconds"), "registrations": runs[0]["registrations"],
            "p2p_phase_seconds_median": med("p2p_phase_seconds"), "transfer_seconds_median": med("transfer_seconds"),
            "phase_minus_transfer_s": med("p2p_phase_seconds") - med("transfer_seconds"),
            "logits_equal_all": all(r["logits_equal"] for r in runs),
        }
        try:
            import torch

            res["machine"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        except Exception:  # noqa: BLE001
            pass
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res.get("summary"), indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
