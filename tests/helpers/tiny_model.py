"""Tiny random models for tests, made by scripts/kits/make_tiny_model.py and cached by content.

The cache key is the generator script's sha256 + seed + size, so a changed script makes new models.
Concurrent test sessions share the cache safely (a file lock; the script publishes by rename).
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "kits" / "make_tiny_model.py"


def model_key(seed: int = 0, size: str = "tiny", vocab: int | None = None) -> str:
    digest = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:12]
    return f"{size}-seed{seed}{'' if vocab is None else f'-vocab{vocab}'}-{digest}"


def make_model(out: Path, seed: int = 0, size: str = "tiny", python: str = sys.executable,
               vocab: int | None = None) -> Path:
    """Run the generator into `out` (must not exist or be empty); `vocab`: the tokenizer's size (default 2048)."""
    extra = [] if vocab is None else ["--vocab", str(vocab)]
    result = subprocess.run(
        [python, str(SCRIPT), "--out", str(out), "--seed", str(seed), "--size", size, *extra],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"make_tiny_model.py failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return out


def cached_model(cache_root: Path, seed: int = 0, size: str = "tiny", python: str = sys.executable,
                 vocab: int | None = None) -> Path:
    """The model for (seed, size, vocab) from cache_root, generated once."""
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    key = model_key(seed, size, vocab)
    out = cache_root / key
    with open(cache_root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            make_model(out, seed, size, python, vocab)
    return out


def tree_digest(folder: Path) -> str:
    """sha256 over every file's name and bytes, in name order."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()
