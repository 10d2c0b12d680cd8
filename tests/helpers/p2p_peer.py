"""A P2P source or target process for the tests, through the plugin core (plugin/p2p.py, plugin/p2p_source.py) and real NIXL.

    python -m tests.helpers.p2p_peer serve  --registry DIR --layout processed|raw --seed 0 --size tiny --ready FILE
    python -m tests.helpers.p2p_peer pull   --registry DIR --layout processed --size tiny --out FILE
    python -m tests.helpers.p2p_peer attack --registry DIR|URL --tensor NAME --out FILE [--source-id ID]

`serve` publishes its model and waits to be killed; `pull` builds a model with other values, pulls, and
writes {"equal": bool, ...} comparing with the source's seed. `attack` is issue 29's outsider: with a
source's record in hand (read as whoever runs it can), it starts its own NIXL agent and one-sided WRITEs
junk over one tensor of the live source; it writes {"wrote": bytes, "tensor", "worker"} (or {"error"}).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mxlaunch.coord.peers import open_registry
from mxlaunch.plugin import p2p, p2p_agent, p2p_source
from mxlaunch.plugin.loader import module_tensors
from mxlaunch.transfer.tensor_set import processed_tensors
from tests.helpers.p2p_models import build

SOURCE_ID = "p2ptest0123456789"


def serve(args: argparse.Namespace) -> None:
    registry = open_registry(f"file:{args.registry}", None)
    if args.layout == "raw":
        model = build(args.seed, args.size, post=False)
        what = p2p_source.keep_raw(module_tensors(model))
        model.post_process(args.variant)
    else:
        model = build(args.seed, args.size, variant=args.variant)
        what = processed_tensors(model)
    pub = p2p_source.serve(what, registry=registry, source_id=args.source_id, rank=0, world=1, layout=args.layout,
                    run_id=args.run_id, ttl_s=args.ttl)
    ready = Path(args.ready)
    tmp = ready.with_name(ready.name + ".tmp")
    tmp.write_text(json.dumps({"worker": pub.record.worker}))
    tmp.rename(ready)  # whole or absent: the test reads it as soon as the name exists
    time.sleep(args.seconds)


def pull(args: argparse.Namespace) -> None:
    registry = open_registry(f"file:{args.registry}", None)
    model = build(args.seed, args.size, post=args.layout == "processed")
    named = processed_tensors(model) if args.layout == "processed" else module_tensors(model)
    result = p2p.pull(named, registry=registry, source_id=args.source_id, rank=0, world=1, layout=args.layout)
    if args.layout == "raw":
        model.post_process()
    gold = build(0, args.size)
    equal = all(torch.equal(a, b) for (_, a), (_, b) in zip(processed_tensors(gold), processed_tensors(model)))
    a = p2p_agent.agent()
    Path(args.out).write_text(json.dumps({"equal": equal, "bytes": result.bytes, "source": result.source,
                                          "ucx_params": a.ucx_params, "prepped": a.pull_config.prepped,
                                          "progress_thread": a.progress_thread}))


def _registry(where: str):
    return open_registry(where if "://" in where or where.startswith("file:") else f"file:{where}", None)


def attack(args: argparse.Namespace) -> None:
    """WRITE 0x5A bytes over `--tensor` of the freshest live source, through its record alone."""
    from mxlaunch.transfer.nixl import Agent
    from mxlaunch.transfer.regions import Region
    from mxlaunch.transfer.tensor_set import Pair

    try:
        entries = _registry(args.registry).sources(args.source_id, 0)
        if not entries:
            raise RuntimeError("no source record readable")
        rec = entries[0].record
        (entry,) = [e for e in rec.tensors if e["name"] == args.tensor or args.tensor in e.get("aliases", [])]
        junk = torch.full((int(entry["bytes"]),), 0x5A, dtype=torch.uint8)
        agent = Agent("outsider-" + str(time.time_ns()))
        agent.register([Region(junk.data_ptr(), junk.numel(), 0, "cpu")])
        pair = Pair(args.tensor, junk.data_ptr(), int(entry["addr"]), junk.numel(), 0, int(entry["dev"]), "cpu",
                    str(entry.get("device", "cpu")))
        stats = agent.pull(rec.metadata_bytes(), [pair], op="WRITE", timeout_s=60)
        agent.close()
        result = {"wrote": stats.bytes, "tensor": args.tensor, "worker": rec.worker}
    except Exception as exc:  # noqa: BLE001 - the test reads why
        result = {"error": f"{type(exc).__name__}: {exc}"}
    Path(args.out).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("serve", "pull", "attack"))
    ap.add_argument("--registry", required=True)
    ap.add_argument("--layout", default="processed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--variant", default="")
    ap.add_argument("--source-id", default=SOURCE_ID)
    ap.add_argument("--run-id", default="testrun")
    ap.add_argument("--ttl", type=float, default=15.0)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--ready", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--tensor", default="embed.weight")
    args = ap.parse_args(argv)
    {"serve": serve, "pull": pull, "attack": attack}[args.role](args)


if __name__ == "__main__":
    main(sys.argv[1:])
