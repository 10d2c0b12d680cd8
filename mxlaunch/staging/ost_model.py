"""A model of Lustre OSTs for tests and benchmarks: every read held to its OST's service curve.

There is no Lustre here, but how a read schedule behaves against OSTs can still be shown. Each OST serves
its requests in flight together (processor sharing) at a bandwidth that grows with how many there are —
one OST needs many requests in flight (servekit's measurements: one `dd` reader 0.37 GB/s, 64 readers
6.7 GB/s; a file on one OST 0.72 GB/s at 32 streams) — up to the OST's ceiling:

    B(n) = ceiling · (1 − exp(−n / n_half·ln 2))      (n requests in flight; B(n_half) = ceiling / 2)

and all OSTs together are capped by the client's link (`link_bps`). A request's bytes are placed on OSTs
by the file's real layout (staging/lustre.py: plain, multi-stripe, PFL, DoM, overstriped); a request that
spans stripes is split, its parts served at once on their OSTs, as Lustre's client does. The model is
event-driven in real time: `serve` returns when the modelled transfer would have ended, and `transfer`
holds the caller's real copy of the bytes inside the modelled transfer, as a real read's bytes arrive
during it. Time advances from one part's end to the next, whenever its thread wakes, so a thread that
wakes late (64 of them on 2 cores) delays only its own next request, not its OST's other ones.

Only code passes a model (StageJob(ost_model=...), scripts/bench/bench_ost_model.py): no setting turns it on,
so no production staging is ever slowed by it. It records each OST's delivered bytes over time, the time
it had work and its requests in flight, for the per-OST utilisation and depth the benchmark reports.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

from mxlaunch.staging.lustre import Layout

MDT = "mdt"  # a DoM component's bytes live on the MDT: one more server, same curve
_DONE_BYTES = 1e-3  # a part with less left than this has ended (float steps do not land on 0 exactly)
_MAX_SLEEP_S = 1.0  # a waiter's longest sleep without news: a safety net, not how it learns of changes


@dataclass(frozen=True)
class OstCurve:
    """One OST's bandwidth against requests in flight."""

    ceiling_bps: float
    n_half: float = 4.0  # requests in flight for half the ceiling

    def bandwidth(self, n: int) -> float:
        if n <= 0:
            return 0.0
        return self.ceiling_bps * (1.0 - math.exp(-n * math.log(2) / self.n_half))


@dataclass(eq=False)
class _Part:
    server: str
    left: float
    rate: float = 0.0
    waiter: Optional[threading.Condition] = None  # the serving thread's, woken when this part speeds up


@dataclass
class ServerStats:
    """What one OST did: bytes, seconds with work, and bytes per time bucket (utilisation over time)."""

    bytes: float = 0.0
    busy_s: float = 0.0
    inflight_s: float = 0.0  # requests in flight × seconds: / busy_s is the mean depth while busy
    buckets: dict[int, float] = field(default_factory=dict)
    inflight_buckets: dict[int, float] = field(default_factory=dict)


class OstModel:
    """Layouts of the files (by index, as StageJob numbers them), the OSTs' curve and the link's cap."""

    def __init__(self, layouts: list[Optional[Layout]], curve: OstCurve, link_bps: float, bucket_s: float = 0.1,
                 copy_inside: bool = True) -> None:
        self.layouts = layouts
        self.copy_inside = copy_inside  # False: the copy after the modelled transfer (the benchmark before 2026-12-02)
        self.curve = curve
        self.link_bps = link_bps
        self.bucket_s = bucket_s
        self._lock = threading.Lock()
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
        with self.transfer(file_index, offset, length):
            pass

    @contextmanager
    def transfer(self, file_index: int, offset: int, length: int) -> Iterator[None]:
        """The modelled transfer of this read, with the caller's real copy of its bytes inside it.

        A real read's bytes arrive during its transfer; copying them after the modelled one (as `serve`
        then a copy did) left the request's place on its OST empty for the copy's time — 9–46 ms per
        4 MiB with 64 threads on 2 cores — which no schedule could avoid. The block ends when both have.
        """
        mine = self._begin(file_index, offset, length)
        if not self.copy_inside:
            self._end(mine)
            yield
            return
        try:
            yield
        except BaseException:
            self._drop(mine)
            raise
        self._end(mine)

    def _begin(self, file_index: int, offset: int, length: int) -> list[_Part]:
        mine = [_Part(server, float(n)) for server, n in self.split(file_index, offset, length) if n > 0]
        with self._lock:
            now = time.monotonic()
            if self.t0 is None:
                self.t0 = self._last = now
            self._advance(now)
            self._parts.extend(mine)
            self._rates()  # the others on these servers slow down: their own timers wake them early
        return mine

    def _end(self, mine: list[_Part]) -> None:
        """Wait until this request's parts are served: asleep until the projected end, woken sooner
        only when its rate rises (a request left its server, or the link's share grew)."""
        wake = threading.Condition(self._lock)
        with self._lock:
            for p in mine:
                p.waiter = wake
            while True:
                self._advance(time.monotonic())
                if not any(p.left > 0 for p in mine):
                    break
                ends = [p.left / p.rate for p in mine if p.left > 0 and p.rate > 0]
                wake.wait(timeout=min(_MAX_SLEEP_S, max(ends, default=_MAX_SLEEP_S)))
            self._drop_locked(mine)

    def _drop(self, mine: list[_Part]) -> None:
        with self._lock:
            self._advance(time.monotonic())
            self._drop_locked(mine)

    def _drop_locked(self, mine: list[_Part]) -> None:
        for p in mine:
            if p in self._parts:
                self._parts.remove(p)
        self._rates()

    def _advance(self, now: float) -> None:
        """Move every part on to `now`, from completion to completion: a part that ended before `now`
        stops sharing its server at its own end, not when its thread wakes (threads on a busy 2-core VM
        wake late; the others' bandwidth must not wait for them)."""
        while now > self._last:
            active = [p for p in self._parts if p.left > 0 and p.rate > 0]
            if not active:
                self._last = now
                return
            step = min(now - self._last, min(p.left / p.rate for p in active))
            self._move(active, step)
            self._last += step
            if any(p.left <= 0 for p in active):
                self._rates()

    def _move(self, active: list[_Part], step: float) -> None:
        """`step` seconds at the current rates; bytes, busy time and requests in flight per server."""
        inflight: dict[str, int] = {}
        for p in active:
            moved = min(p.left, p.rate * step)
            p.left = 0.0 if p.left - moved <= _DONE_BYTES else p.left - moved
            self.stats.setdefault(p.server, ServerStats()).bytes += moved
            inflight[p.server] = inflight.get(p.server, 0) + 1
        for server, n in inflight.items():
            self.stats[server].busy_s += step
            self.stats[server].inflight_s += n * step
        for bucket, seconds in self._buckets(step):  # a step may span buckets: no events in a whole wave
            for p in active:
                st = self.stats[p.server]
                st.buckets[bucket] = st.buckets.get(bucket, 0.0) + p.rate * seconds
                st.inflight_buckets[bucket] = st.inflight_buckets.get(bucket, 0.0) + seconds

    def _buckets(self, step: float) -> list[tuple[int, float]]:
        """(bucket, seconds in it) of the step from self._last, for the timelines."""
        t0 = self.t0 if self.t0 is not None else self._last
        start, end, out = self._last - t0, self._last - t0 + step, []
        while end - start > 1e-12:
            bucket = int(start / self.bucket_s + 1e-9)
            stop = min(end, (bucket + 1) * self.bucket_s)
            out.append((bucket, stop - start))
            start = stop
        return out

    def _rates(self) -> None:
        """Processor sharing on each server, then the link's cap over all of them; a waiter whose
        rate rose is woken (its end moved earlier than it sleeps for)."""
        active: dict[str, list[_Part]] = {}
        for p in self._parts:
            if p.left > 0:
                active.setdefault(p.server, []).append(p)
        total = sum(self.curve.bandwidth(len(ps)) for ps in active.values())
        scale = min(1.0, self.link_bps / total) if total > 0 else 1.0
        for ps in active.values():
            each = self.curve.bandwidth(len(ps)) / len(ps) * scale
            for p in ps:
                if each > p.rate and p.waiter is not None:
                    p.waiter.notify()
                p.rate = each

    # ---- the report ----

    def report(self, seconds: float) -> dict:
        """Per server: bytes, busy fraction, mean utilisation (delivered / ceiling), mean requests in
        flight while busy, and per time bucket its utilisation and mean requests in flight (depth)."""
        out = {}
        buckets = range(int(seconds / self.bucket_s) + 1)
        for server, st in sorted(self.stats.items()):
            out[server] = {
                "bytes": round(st.bytes), "busy_fraction": round(st.busy_s / seconds, 3) if seconds else 0.0,
                "utilisation": round(st.bytes / (self.curve.ceiling_bps * seconds), 3) if seconds else 0.0,
                "mean_in_flight": round(st.inflight_s / st.busy_s, 2) if st.busy_s else 0.0,
                "timeline": [round(st.buckets.get(i, 0.0) / (self.curve.ceiling_bps * self.bucket_s), 3)
                             for i in buckets],
                "depth_timeline": [round(st.inflight_buckets.get(i, 0.0) / self.bucket_s, 1) for i in buckets],
            }
        return out
