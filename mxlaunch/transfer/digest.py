"""Per-tensor checksums of the bytes a P2P transfer moves, so that a target never serves bytes that differ
from what its source loaded.

NIXL registers memory for remote READ *and* WRITE (docs/p2p.md, "Read-only exposure"): anyone holding a
source's record can overwrite its registered memory. So the source computes a checksum of every tensor's
bytes when it publishes — from its own loaded tensors, before registering them — and puts it in the
record; a target recomputes it over what it pulled, before post-processing and serving, and treats a
difference as a failed pull with bytes landed (rebuild and load by the default loader, or stop).

Two algorithms, named in each digest ("algo:hex"), so either side computes the one the other used:
    xxh3-128  the `xxhash` package over the bytes in host memory (CPU tensors; ~10+ GB/s a core)
    mx128     torch on the tensor's own device (GPU tensors: no copy to the host). The bytes as 64-bit
              words w_i (a zero-padded last word; the byte count folded in): h_i = fmix(w_i ^ (i·K1 + K0)),
              g_i = fmix(h_i + K2), digest = (Σ h_i, Σ g_i) mod 2^64. fmix is MurmurHash3's 64-bit
              finalizer (xor-shift-multiply, a bijection that spreads every input bit over the word), and
              the position enters each word, so a changed, swapped or moved word changes the sums except
              with probability ~2^-64 per lane for changes that are not crafted. Integer sums are exact
              modulo 2^64, so the result is the same on any device and in any reduction order.
mx128 over many small tensors is computed in batches (`digests`): their bytes concatenated, each padded to whole
words, hashed in one pass and summed per tensor (`index_add_`), so a rank of hundreds of tensors costs a few
kernel launches per batch instead of ~30 launches and a synchronisation per tensor
(on an H100 the per-tensor form took 0.31–0.48 s of a 0.40–0.64 s P2P weight phase whose transfer took
0.004–0.02 s: docs/benchmarks.md, session 29); every tensor's sums, large ones too, stay on the device until
one synchronisation at the end. The sums are the same integers in any order: the same digests.
Neither is a cryptographic MAC: someone who can write a source's memory AND knows the scheme could craft
bytes with the same sums (the record's privacy is the first defence; these catch corruption, stray writes
and naive tampering). Cost: measured in tests/unit/test_p2p_digest.py and docs/p2p.md.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from mxlaunch.plugin.tensors import group_tensors
from mxlaunch.transfer.tensor_set import byte_view, span_bytes

XXH3 = "xxh3-128"
MIX = "mx128"
ALGOS = (XXH3, MIX)
CHUNK = 32 << 20  # bytes hashed at once (bounds the temporaries on the device; a multiple of 8)
BATCHED = 4 << 20  # mx128 tensors up to this size are hashed together (`digests`), up to CHUNK bytes a batch

_M64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch holds."""
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


K0, K1, K2 = _s64(0x9E3779B97F4A7C15), _s64(0xC2B2AE3D27D4EB4F), _s64(0x165667B19E3779F9)
F1, F2 = _s64(0xFF51AFD7ED558CCD), _s64(0xC4CEB9FE1A85EC53)


def algo_for(t: torch.Tensor) -> str:
    """The algorithm a source uses for a tensor: mx128 on a GPU (stays there), xxh3-128 elsewhere."""
    return MIX if t.device.type == "cuda" else XXH3


def digest(t: torch.Tensor, algo: str | None = None) -> str:
    """"algo:hex" of the bytes a transfer moves for `t` (its span: byte_view)."""
    algo = algo or algo_for(t)
    data = _bytes_of(t)
    if algo == XXH3:
        return f"{XXH3}:{_xxh3(data)}"
    if algo == MIX:
        return f"{MIX}:{_mix(data)}"
    raise ValueError(f"unknown checksum algorithm {algo!r}")


def _xxh3(data: torch.Tensor) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    n = data.numel()
    for lo in range(0, n, CHUNK if data.device.type != "cpu" else max(n, 1)):
        part = data[lo:lo + CHUNK] if data.device.type != "cpu" else data
        h.update(memoryview(part.cpu().numpy()))
    return h.hexdigest()


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> keeps the sign)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _fmix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 33)
    x = x * F1
    x = x ^ _shr(x, 33)
    x = x * F2
    return x ^ _shr(x, 33)


def _mix(data: torch.Tensor) -> str:
    (hexed,) = _finish(_mix_sums(data).view(2, 1), [data.numel()])
    return hexed


def _mix_sums(data: torch.Tensor) -> torch.Tensor:
    """mx128's two sums over `data` (uint8), chunk by chunk, left on its device: no synchronisation."""
    n = data.numel()
    sums = torch.zeros(2, dtype=torch.int64, device=data.device)
    index = None
    for lo in range(0, n, CHUNK):
        part = data[lo:lo + CHUNK]
        if part.numel() % 8 or part.storage_offset() % 8:
            padded = torch.zeros(-(-part.numel() // 8) * 8, dtype=torch.uint8, device=data.device)
            padded[:part.numel()] = part
            part = padded
        words = part.view(torch.int64)
        if index is None or index.numel() < words.numel():
            index = torch.arange(words.numel(), dtype=torch.int64, device=data.device)
        pos = index[:words.numel()] + lo // 8
        h = _fmix(words ^ (pos * K1 + K0))
        sums[0] += h.sum()
        sums[1] += _fmix(h + K2).sum()
    return sums


def _finish(sums: torch.Tensor, sizes: Sequence[int]) -> list[str]:
    """The hex digests from (2, k) sums and the tensors' byte counts: the one synchronisation (`tolist`)."""
    out = []
    for n, (a, b) in zip(sizes, zip(*sums.tolist())):
        la, lb = (a + _fmix_int(n ^ K0)) & _M64, b & _M64  # the length: zero padding cannot pass for bytes
        out.append(f"{la:016x}{lb:016x}")
    return out


def _fmix_int(x: int) -> int:
    """fmix on a Python int (mod 2^64), for the length word and the tests' reference."""
    x &= _M64
    x ^= x >> 33
    x = (x * (F1 & _M64)) & _M64
    x ^= x >> 33
    x = (x * (F2 & _M64)) & _M64
    return x ^ (x >> 33)


def mix_reference(data: bytes) -> str:
    """mx128 in plain Python (slow; tests check the torch version against it on small inputs)."""
    n = len(data)
    padded = data + b"\0" * (-n % 8)
    a = b = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i:8 * i + 8], "little")
        h = _fmix_int(w ^ ((i * (K1 & _M64) + (K0 & _M64)) & _M64))
        a = (a + h) & _M64
        b = (b + _fmix_int(h + (K2 & _M64))) & _M64
    a = (a + _fmix_int(n ^ K0)) & _M64
    return f"{MIX}:{a:016x}{b:016x}"


def digests(tensors: Sequence[torch.Tensor], algos: Sequence[str | None] | None = None) -> list[str]:
    """digest() of each tensor (its algorithm: `algos`, else algo_for). mx128's sums stay on their device until
    the end, one synchronisation per device: the small tensors in batches, the large ones a chunk at a time."""
    chosen = [a or algo_for(t) for t, a in zip(tensors, algos or [None] * len(tensors))]
    out = [""] * len(tensors)
    batches: list[list[int]] = []  # indices of small mx128 tensors: one device, at most CHUNK bytes a batch
    large: list[int] = []
    size = 0
    for i, (t, algo) in enumerate(zip(tensors, chosen)):
        n = span_bytes(t) if t.numel() else 0
        if algo != MIX:
            out[i] = digest(t, algo)
        elif n > BATCHED:
            large.append(i)
        else:
            if not batches or tensors[batches[-1][0]].device != t.device or size + n > CHUNK:
                batches.append([])
                size = 0
            batches[-1].append(i)
            size += n
    pending: dict[torch.device, tuple[list[int], list[int], list[torch.Tensor]]] = {}
    for group, whole in [([i], True) for i in large] + [(b, False) for b in batches]:
        datas = [_bytes_of(tensors[i]) for i in group]
        sums = _mix_sums(datas[0]).view(2, 1) if whole else _mix_many_sums(datas)
        index, sizes, parts = pending.setdefault(datas[0].device, ([], [], []))
        index += group
        sizes += [d.numel() for d in datas]
        parts.append(sums)
    for index, sizes, parts in pending.values():
        for i, hexed in zip(index, _finish(torch.cat(parts, dim=1), sizes)):
            out[i] = f"{MIX}:{hexed}"
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return byte_view(t) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _mix_many_sums(datas: Sequence[torch.Tensor]) -> torch.Tensor:
    """mx128's sums of several uint8 tensors on one device (each ≤ CHUNK), (2, k): one concatenation, one pass."""
    device = datas[0].device
    sizes = [d.numel() for d in datas]
    words = [-(-n // 8) for n in sizes]
    zero = torch.zeros(8, dtype=torch.uint8, device=device)
    parts = []
    for d, n, w in zip(datas, sizes, words):
        parts.append(d)
        if w * 8 > n:
            parts.append(zero[:w * 8 - n])
    total = sum(words)
    sums = torch.zeros((2, len(datas)), dtype=torch.int64, device=device)
    if total:
        flat = torch.cat(parts).view(torch.int64)
        counts = torch.tensor(words, dtype=torch.int64, device=device)
        seg = torch.repeat_interleave(torch.arange(len(datas), device=device), counts, output_size=total)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(total, dtype=torch.int64, device=device) - starts[seg]
        h = _fmix(flat ^ (pos * K1 + K0))
        sums[0].index_add_(0, seg, h)
        sums[1].index_add_(0, seg, _fmix(h + K2))
    return sums


def add_digests(groups: Iterable, entries: Sequence[dict]) -> None:
    """Put each group's digest into its manifest entry (the source, at publish time)."""
    groups = list(groups)
    for entry, value in zip(entries, digests([g.tensor for g in groups])):
        entry["digest"] = value


def mismatches(named: Sequence[tuple[str, torch.Tensor]], manifest: Sequence[dict]) -> list[str]:
    """Names of the target's tensors whose bytes differ from the digest the source published (the target,
    after the READ); an entry without a digest counts as a mismatch (nothing proves its bytes)."""
    by_name = {n: g for g in group_tensors(named) for n in g.names}
    bad, checked = [], []
    for e in manifest:
        g = by_name.get(e["name"])
        want = e.get("digest")
        if g is None or not isinstance(want, str) or ":" not in want or want.split(":", 1)[0] not in ALGOS:
            bad.append(e["name"])
        else:
            checked.append((e["name"], g.tensor, want))
    got = digests([t for _, t, _ in checked], [want.split(":", 1)[0] for _, _, want in checked])
    bad += [name for (name, _, want), have in zip(checked, got) if have != want]
    order = {e["name"]: i for i, e in enumerate(manifest)}
    return sorted(bad, key=order.__getitem__)
