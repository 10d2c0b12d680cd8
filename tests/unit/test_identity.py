"""Source ids: pinned for known inputs, and changing exactly when the per-rank tensors can change."""

from __future__ import annotations

import copy
import json
import os
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from mxlaunch.engines.vllm_argv import parse_vllm_argv
from mxlaunch.identity import (
    canonical_json,
    checkpoint_fingerprint,
    hub_revision,
    id_of,
    identity_fields,
    safetensors_header_hash,
    source_id,
)

MTIME_NS = 1_700_000_000_123_456_789
API = "vllm.entrypoints.openai.api_server"


def safetensors_bytes(tensors: dict) -> bytes:
    """A real safetensors file: 8-byte little-endian header length, JSON header, raw data."""
    header, data, off = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def make_checkpoint(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}\n')
    (root / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}\n')
    (root / "tokenizer.json").write_text("{}")  # not part of the layout
    (root / "model-00001-of-00002.safetensors").write_bytes(safetensors_bytes({"a": ("F32", [2, 2], bytes(range(16)))}))
    (root / "model-00002-of-00002.safetensors").write_bytes(safetensors_bytes({"b": ("F32", [4], bytes(16))}))
    for p in root.iterdir():
        os.utime(p, ns=(MTIME_NS, MTIME_NS))
    return root


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "tiny")


def spec_for(model: str, *extra: str, version: str = "0.32.0"):
    return parse_vllm_argv(["vllm", "serve", model, *extra], engine_version=version)


# ---- pinned ----------------------------------------------------------------------------------------

PINNED_FINGERPRINT = {
    "config": "20af3666268a0fc967f46dc85269503b0441ab2913bd29412d3eb872ac23dc2b",  # = sha256sum config.json
    "layout_files": {"model.safetensors.index.json": "d3e58ec901ca72564c8bf6ec19e219507a36c0228192f0b96ffc6e2d7a16f5e8"},
    "code": {},
    "weights": [
        {
            "name": "model-00001-of-00002.safetensors",
            "size": 88,
            "mtime_ns": MTIME_NS,
            "header": "620241b7459e12b5a8727266a6bc636c2b7a4e3dcdec9abbcaabdcb24dc82188",
        },
        {
            "name": "model-00002-of-00002.safetensors",
            "size": 80,
            "mtime_ns": MTIME_NS,
            "header": "a53ba83ca411f9f8d97d758faecf22a9945b0dff8a8f913115e74cdecd6db430",
        },
    ],
    "hub_revision": None,
}


def test_pinned_fingerprint_and_id(ckpt: Path) -> None:
    fp = checkpoint_fingerprint(str(ckpt))
    assert fp == PINNED_FINGERPRINT
    fields = identity_fields(spec_for(str(ckpt), "-tp", "2", "--dtype", "float32"), device_type="cpu")
    assert fields["model"]["path"] == str(ckpt.resolve())
    fields["model"]["path"] = "/models/tiny"  # the only part that depends on where the test runs
    assert id_of(fields) == "935cb23d43d844f9"


def test_pinned_id_without_a_local_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    spec = spec_for("org/not-downloaded", "-tp", "4", "-q", "fp8")
    assert spec.model_path is None
    assert identity_fields(spec, device_type="cuda") == {
        "engine": "vllm",
        "engine_version": "0.32.0",
        "device_type": "cuda",
        "model": {"name": "org/not-downloaded", "revision": None},
        "tp": 4,
        "pp": 1,
        "ep": 1,
        "dtype": "auto",
        "quantization": "fp8",
        "layout_extras": {},
        "snapshot": {"format": "raw", "version": 1},
    }
    assert source_id(spec, device_type="cuda") == "41fc0ce0dc1de8bc"
    assert source_id(spec, device_type="cuda", snapshot_version=2) != source_id(spec, device_type="cuda")
    assert source_id(spec, device_type="cuda", snapshot_format="sharded_state") != source_id(spec, device_type="cuda")
    assert source_id(spec, device_type="cpu") != source_id(spec, device_type="cuda")


def test_canonical_json_sorts_and_lowercases() -> None:
    a = {"b": "FP8", "a": {"Y": ["X", 1, None, True]}}
    assert canonical_json(a) == '{"a":{"y":["x",1,null,true]},"b":"fp8"}'
    assert id_of(a) == id_of({"a": {"y": ["x", 1, None, True]}, "b": "fp8"})
    assert len(id_of(a)) == 16 and int(id_of(a), 16) >= 0


# ---- what changes the id, and what does not --------------------------------------------------------


def test_touching_a_weight_file_changes_the_id(ckpt: Path) -> None:
    spec = spec_for(str(ckpt))
    before = source_id(spec, device_type="cpu")
    assert source_id(spec, device_type="cpu") == before  # stable
    w = ckpt / "model-00002-of-00002.safetensors"
    os.utime(w, ns=(MTIME_NS, MTIME_NS + 1))
    assert source_id(spec, device_type="cpu") != before


def test_rewriting_a_header_changes_the_id_even_with_the_old_mtime(ckpt: Path) -> None:
    spec = spec_for(str(ckpt))
    before = source_id(spec, device_type="cpu")
    w = ckpt / "model-00001-of-00002.safetensors"
    data = w.read_bytes()
    new = data.replace(b'"F32"', b'"I32"')  # same length: only the header's bytes differ
    assert new != data and len(new) == len(data)
    w.write_bytes(new)
    os.utime(w, ns=(MTIME_NS, MTIME_NS))
    assert source_id(spec, device_type="cpu") != before
    w.write_bytes(data)
    os.utime(w, ns=(MTIME_NS, MTIME_NS))
    assert source_id(spec, device_type="cpu") == before


def test_config_size_and_new_shard_change_the_id(ckpt: Path) -> None:
    spec = spec_for(str(ckpt))
    ids = {source_id(spec, device_type="cpu")}
    (ckpt / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 128}\n')
    ids.add(source_id(spec, device_type="cpu"))
    w = ckpt / "model-00002-of-00002.safetensors"
    with open(w, "ab") as f:
        f.write(b"\0" * 8)
    os.utime(w, ns=(MTIME_NS, MTIME_NS))
    ids.add(source_id(spec, device_type="cpu"))
    (ckpt / "extra.safetensors").write_bytes(safetensors_bytes({}))
    ids.add(source_id(spec, device_type="cpu"))
    (ckpt / "modeling_custom.py").write_text("# remote code\n")
    ids.add(source_id(spec, device_type="cpu"))
    assert len(ids) == 5
    # a tokenizer edit leaves the tensors alone
    (ckpt / "tokenizer.json").write_text('{"changed": true}')
    assert source_id(spec, device_type="cpu") in ids


def test_parallelism_rules(ckpt: Path) -> None:
    def sid(*extra: str) -> str:
        return source_id(spec_for(str(ckpt), *extra), device_type="cuda")

    base = sid("-tp", "2")
    assert sid("-tp", "2", "-dp", "4") == base  # plain DP replicas hold the same shards
    assert sid("-tp", "2", "--port", "9000", "--served-model-name", "x", "--nnodes", "2", "--node-rank", "1") == base
    assert sid("-tp", "2", "--load-format", "safetensors", "--model-loader-extra-config", '{"a": 1}') == base
    assert sid("-tp", "4") != base
    assert sid("-tp", "2", "-pp", "2") != base
    ep2 = sid("-tp", "2", "--enable-expert-parallel")
    assert ep2 != base  # experts split over EP (2 ranks)
    assert sid("-tp", "2", "-dp", "2", "-ep") != ep2  # EP over dp × tp = 4 ranks: DP now matters
    assert sid("-tp", "2", "-dp", "2", "-ep") == sid("-tp", "2", "-dp", "2", "--enable-expert-parallel", "--max-model-len", "4096")
    assert sid("-tp", "2", "--dtype", "bfloat16") != base
    assert sid("-tp", "2", "-q", "fp8") != base
    assert sid("-tp", "2", "-q", "FP8") == sid("-tp", "2", "--quantization=fp8")  # strings are lower-cased
    assert sid("-tp", "2", "--hf-overrides", '{"num_hidden_layers": 1}') != base
    assert sid("-tp", "2", "--model-impl", "transformers") != base
    other_version = source_id(spec_for(str(ckpt), "-tp", "2", version="0.33.0"), device_type="cuda")
    assert other_version != base


def test_launch_form_does_not_matter(ckpt: Path) -> None:
    a = parse_vllm_argv(["vllm", "serve", str(ckpt), "-tp", "2"], engine_version="0.32.0")
    b = parse_vllm_argv(["python3", "-m", API, "--tensor_parallel_size=2", "--model", str(ckpt)], engine_version="0.32.0")
    assert source_id(a, device_type="cpu") == source_id(b, device_type="cpu")


def test_hub_snapshot_revision_is_in_the_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    repo = hub / "models--org--tiny"
    c1, c2 = "1" * 40, "2" * 40
    for c in (c1, c2):
        make_checkpoint(repo / "snapshots" / c)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(c1)
    s1 = spec_for("org/tiny")
    s2 = spec_for("org/tiny", "--revision", c2)
    assert hub_revision(s1.model_path) == c1 and hub_revision(s2.model_path) == c2
    f1 = identity_fields(s1, device_type="cpu")
    assert f1["model"]["fingerprint"]["hub_revision"] == c1
    assert source_id(s1, device_type="cpu") != source_id(s2, device_type="cpu")  # same bytes, other commit
    assert hub_revision(str(tmp_path)) is None


# ---- headers -----------------------------------------------------------------------------------------


def bytes_read() -> int:
    """What this process has read through read() and friends so far (/proc/self/io's rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_header_is_read_without_the_tensors(tmp_path: Path) -> None:
    big = tmp_path / "big.safetensors"
    head = safetensors_bytes({"w": ("F32", [1024, 1024, 1024], b"")})
    with open(big, "wb") as f:
        f.write(head)
        f.truncate(len(head) + (4 << 30))  # 4 GiB of (sparse) tensor data
    before = bytes_read()
    h = safetensors_header_hash(big)
    assert bytes_read() - before < 1 << 20  # the header (and /proc/self/io itself), not the 4 GiB behind it
    small = tmp_path / "small.safetensors"
    small.write_bytes(head)
    assert safetensors_header_hash(small) == h  # only the header counts in this hash


def test_truncated_header_is_marked(tmp_path: Path) -> None:
    p = tmp_path / "bad.safetensors"
    good = safetensors_bytes({"w": ("F32", [2], bytes(8))})
    p.write_bytes(good[:20])
    assert safetensors_header_hash(p).startswith("truncated:")
    p.write_bytes(good[:3])
    assert safetensors_header_hash(p).startswith("truncated:")
    p.write_bytes(good)
    assert not safetensors_header_hash(p).startswith("truncated:")


def test_identity_fields_are_json_and_not_shared(ckpt: Path) -> None:
    spec = spec_for(str(ckpt), "--hf-overrides", '{"a": {"b": 1}}')
    fields = identity_fields(spec, device_type="cpu")
    json.dumps(fields)
    snapshot = copy.deepcopy(spec.layout_extras)
    fields["layout_extras"]["x"] = 1
    assert spec.layout_extras == snapshot
    with pytest.raises(ValueError):
        identity_fields(spec, device_type="")
    assert replace(spec, port=1) != spec  # LaunchSpec is a plain dataclass
