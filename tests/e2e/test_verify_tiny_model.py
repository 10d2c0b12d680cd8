"""scripts/kits/make_tiny_model.py: byte-identical per seed, different across seeds, loadable shapes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.tiny_model import make_model, tree_digest


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", seed=0)
    b = make_model(tmp_path / "b", seed=0)
    c = make_model(tmp_path / "c", seed=1)
    assert tree_digest(a) == tree_digest(b)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    config = json.loads((a / "config.json").read_text())
    assert config["head_dim"] >= 32 and config["max_position_embeddings"] >= 2048
    assert config["dtype"] == "float32"


def test_sized_model_is_sharded_with_an_index(tmp_path: Path) -> None:
    out = make_model(tmp_path / "m", seed=0, size="64MiB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and set(index["weight_map"].values()) == set(shards)
    total = sum((out / s).stat().st_size for s in shards)
    assert 0.8 * 64 * 2**20 < total < 1.25 * 64 * 2**20
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
