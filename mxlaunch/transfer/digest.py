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
Neither is a cryptographic MAC: someone who can write a source's memory AND knows the scheme could craft
bytes with the same sums (the record's privacy is the first defence; these catch corruption, stray writes
and naive tampering). Cost: measured in tests/unit/test_p2p_digest.py and docs/p2p.md.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from mxlaunch.plugin.tensors import group_tensors
from mxlaunch.transfer.tensor_set import byte_view

XXH3 = "xxh3-128"
MIX = "mx128"
ALGOS = (XXH3, MIX)
CHUNK = 32 << 20  # bytes hashed at once (bounds the temporaries on the device; a multiple of 8)

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
    data = byte_view(t) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
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
    n = data.numel()
    a = torch.zeros((), dtype=torch.int64, device=data.device)
    b = torch.zeros((), dtype=torch.int64, device=data.device)
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
        a += h.sum()
        b += _fmix(h + K2).sum()
    la, lb = (int(v) & _M64 for v in torch.stack([a, b]).tolist())
    la = (la + _fmix_int(n ^ K0)) & _M64  # the length: zero padding cannot pass for bytes
    return f"{la:016x}{lb:016x}"


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


def add_digests(groups: Iterable, entries: Sequence[dict]) -> None:
    """Put each group's digest into its manifest entry (the source, at publish time)."""
    for g, entry in zip(groups, entries):
        entry["digest"] = digest(g.tensor)


def mismatches(named: Sequence[tuple[str, torch.Tensor]], manifest: Sequence[dict]) -> list[str]:
    """Names of the target's tensors whose bytes differ from the digest the source published (the target,
    after the READ); an entry without a digest counts as a mismatch (nothing proves its bytes)."""
    by_name = {n: g for g in group_tensors(named) for n in g.names}
    bad = []
    for e in manifest:
        g = by_name.get(e["name"])
        want = e.get("digest")
        if g is None or not isinstance(want, str) or ":" not in want:
            bad.append(e["name"])
            continue
        algo = want.split(":", 1)[0]
        if algo not in ALGOS or digest(g.tensor, algo) != want:
            bad.append(e["name"])
    return bad
