"""A model of Lustre OSTs for tests and benchmarks: every read held to its OST's service curve.

There is no Lustre here, but how a read schedule behaves against OSTs can still be shown. Each OST serves
its requests in flight together (processor sharing) at a bandwidth that grows with how many there are —
one OST needs many requests in flight (servekit's measurements: one `dd` reader 0.37 GB/s, 64 readers
6.7 GB/s; a file on one OST 0.72 GB/s at 32 streams) — up to the OST's ceiling:

    B(n) = ceiling · (1 − exp(−n / n_half·ln 2))      (n requests in flight; B(n_half) = ceiling / 2)

and all OSTs together are capped by the client's link (`link_bps`). A request's bytes are placed on OSTs
by the file's real layout (staging/lustre.py: plain, multi-stripe, PFL, DoM, overstriped); a request that
spans stripes is split, its parts served at once on their OSTs, as Lustre's client does. The model is
event-driven in real time: `serve` returns when the modelled transfer would have ended.

Only code passes a model (StageJob(ost_model=...), scripts/bench_ost_model.py): no setting turns it on,
so no production staging is ever slowed by it. It records each OST's delivered bytes over time and the time
it had work, for the per-OST utilisation the benchmark reports.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from mxlaunch.staging.lustre import Layout

MDT = "mdt"  # a DoM component's bytes live on the MDT: one more server, same curve


@dataclass(frozen=True)
class OstCurve:
    """One OST's bandwidth against requests in flight."""

    ceiling_bps: float
    n_half: float = 4.0  # requests in flight for half the ceiling

    def bandwidth(self, n: int) -> float:
        if n <= 0:
            return 0.0
        return self.ceiling_bps * (1.0 - math.exp(-n * math.log(2) / self.n_half))


@dataclass
class _Part:
    server: str
    left: float
    rate: float = 0.0


@dataclass
class ServerStats:
    """What one OST did: bytes, seconds with work, and bytes per time bucket (utilisation over time)."""

    bytes: float = 0.0
    busy_s: float = 0.0
    buckets: dict[int, float] = field(default_factory=dict)


class OstModel:
    """Layouts of the files (by index, as StageJob numbers them), the OSTs' curve and the link's cap."""

    def __init__(self, layouts: list[Optional[Layout]], curve: OstCurve, link_bps: float, bucket_s: float = 0.1) -> None:
        self.layouts = layouts
        self.curve = curve
        self.link_bps = link_bps
        self.bucket_s = bucket_s
        self._cond = threading.Condition()
        self._parts: list[_Part] = []
        self._last = time.monotonic()
        self.t0: Optional[float] = None
        self.stats: dict[str, ServerStats] = {}

    # ---- where bytes live ----

    def split(self, file_index: int, offset: int, length: int) -> list[tuple[str, int]]:
        """(server, bytes) of a read, cut at stripe boundaries; bytes outside any OST component: the MDT."""
        layout = self.layouts[file_index] if file_index < len(self.layouts) else None
        if layout is None:
            return [("ost0", length)]
        parts: dict[str, int] = {}
        pos, end = offset, offset + length
        while pos < end:
            comp = layout.component_at(pos)
            stop = min(end, layout.stripe_end(pos), comp.end if comp is not None else end)
            ost = layout.ost_for(pos)
            server = f"ost{ost}" if ost is not None else MDT
            parts[server] = parts.get(server, 0) + (stop - pos)
            pos = stop
        return list(parts.items())

    def servers(self) -> set[str]:
        out: set[str] = set()
        for layout in self.layouts:
            if layout is None:
                out.add("ost0")
                continue
            out |= {f"ost{o}" for o in layout.ost_set}
            if any(not c.osts for c in layout.components):
                out.add(MDT)
        return out

    def ceiling_bps(self, servers: Optional[set[str]] = None) -> float:
        """Every server at its ceiling, capped by the link (an upper bound; ceiling_for is the reachable one)."""
        return min(self.link_bps, self.curve.ceiling_bps * len(servers or self.servers()))

    def ceiling_for(self, sizes: list[int]) -> float:
        """The best rate any schedule could reach reading these files whole: the bytes each server holds at
        its ceiling, the link for all of them — the slower of the two decides. A server that holds a small
        share (a DoM MDT, the first stripe of a PFL file) cannot add its ceiling to the total."""
        held: dict[str, int] = {}
        for index, size in enumerate(sizes):
            for server, n in self.split(index, 0, size):
                held[server] = held.get(server, 0) + n
        total = sum(held.values())
        if total == 0:
            return self.ceiling_bps()
        fastest = max(max(n / self.curve.ceiling_bps for n in held.values()), total / self.link_bps)
        return total / fastest

    # ---- serving ----

    def serve(self, file_index: int, offset: int, length: int) -> None:
        """Block for the modelled transfer of this read."""
        mine = [_Part(server, float(n)) for server, n in self.split(file_index, offset, length)]
        with self._cond:
            if self.t0 is None:
                self.t0 = self._last = time.monotonic()
            self._advance()
            self._parts.extend(mine)
            self._rates()
            self._cond.notify_all()  # the others' rates changed: they recompute when they end
            while any(p.left > 0 for p in mine):
                ends = [p.left / p.rate for p in mine if p.left > 0 and p.rate > 0]
                self._cond.wait(timeout=min([0.05, *ends]))
                self._advance()
                self._rates()
            for p in mine:
                self._parts.remove(p)
            self._rates()
            self._cond.notify_all()

    def _advance(self) -> None:
        """Move every part on by its rate since the last event; account bytes and busy time per server."""
        now = time.monotonic()
        dt = now - self._last
        if dt <= 0:
            return
        busy: set[str] = set()
        for p in self._parts:
            if p.left <= 0:
                continue
            moved = min(p.left, p.rate * dt)
            p.left -= moved
            st = self.stats.setdefault(p.server, ServerStats())
            st.bytes += moved
            bucket = int(((self._last + now) / 2 - (self.t0 or now)) / self.bucket_s)
            st.buckets[bucket] = st.buckets.get(bucket, 0.0) + moved
            busy.add(p.server)
        for server in busy:
            self.stats[server].busy_s += dt
        self._last = now

    def _rates(self) -> None:
        """Processor sharing on each server, then the link's cap over all of them."""
        active: dict[str, list[_Part]] = {}
        for p in self._parts:
            if p.left > 0:
                active.setdefault(p.server, []).append(p)
        total = sum(self.curve.bandwidth(len(ps)) for ps in active.values())
        scale = min(1.0, self.link_bps / total) if total > 0 else 1.0
        for ps in active.values():
            each = self.curve.bandwidth(len(ps)) / len(ps) * scale
            for p in ps:
                p.rate = each

    # ---- the report ----

    def report(self, seconds: float) -> dict:
        """Per server: bytes, busy fraction, mean utilisation (delivered / ceiling) and its timeline."""
        out = {}
        for server, st in sorted(self.stats.items()):
            out[server] = {
                "bytes": round(st.bytes), "busy_fraction": round(st.busy_s / seconds, 3) if seconds else 0.0,
                "utilisation": round(st.bytes / (self.curve.ceiling_bps * seconds), 3) if seconds else 0.0,
                "timeline": [round(st.buckets.get(i, 0.0) / (self.curve.ceiling_bps * self.bucket_s), 3)
                             for i in range(int(seconds / self.bucket_s) + 1)],
            }
        return out
