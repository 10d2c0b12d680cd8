#!/usr/bin/env python3
"""Where an engine's start-up spends its import time (issue 24): `python -X importtime` of the engine's entry
module, once warm, summed per top-level package and per vLLM/SGLang sub-package, written as JSON.

    python3 scripts/bench/import_profile.py --module vllm.entrypoints.openai.api_server --out import_vllm.json
    python3 scripts/bench/import_profile.py --from importtime.txt --out import_vllm.json   # a trace taken elsewhere

Why: on the H200 machine the API server's first log line comes ~20 s after spawn, before any weight moves; a
launcher cannot shorten an import, only avoid repeating it (the engine core forked, a zygote), so the numbers
say how much a restart from a pre-imported interpreter can save and what the import is made of.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path


def parse(text: str) -> list[tuple[int, str]]:
    """(self µs, module) per `import time:` line."""
    rows = []
    for line in text.splitlines():
        if line.startswith("import time:") and "self [us]" not in line:
            own, _, name = line[len("import time:"):].split("|", 2)
            rows.append((int(own), name.strip()))
    return rows


def summarize(rows: list[tuple[int, str]], top: int = 15) -> dict:
    by_package: dict[str, int] = defaultdict(int)
    by_engine_part: dict[str, int] = defaultdict(int)
    for own, name in rows:
        by_package[name.split(".")[0]] += own
        if name.split(".")[0] in ("vllm", "sglang"):
            by_engine_part[".".join(name.split(".")[:2])] += own
    def ranked(d: dict[str, int]) -> dict[str, float]:
        return {k: round(v / 1e6, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]}
    return {"total_self_s": round(sum(r[0] for r in rows) / 1e6, 3), "modules": len(rows),
            "by_package_s": ranked(by_package), "by_engine_part_s": ranked(by_engine_part)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", default="vllm.entrypoints.openai.api_server")
    ap.add_argument("--from", dest="trace", type=Path, help="summarize this -X importtime trace instead of running")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    doc: dict = {"schema": 1, "module": args.module}
    if args.trace:
        text = args.trace.read_text()
    else:
        subprocess.run([sys.executable, "-c", f"import {args.module}"], check=True, capture_output=True)  # warm
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {args.module}"], capture_output=True,
                              text=True, check=True)
        doc["wall_s"] = round(time.perf_counter() - started, 3)
        text = proc.stderr
    doc.update(summarize(parse(text)))
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: doc[k] for k in ("total_self_s", "by_package_s")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
