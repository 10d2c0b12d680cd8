"""The OPTIONS block both option-table generators print (gen_vllm_flags.py, gen_sglang_flags.py)."""

from __future__ import annotations


def print_options(table: dict[str, str]) -> None:
    """`OPTIONS = {...}`: every option string with its arity, grouped by arity for a readable diff."""
    groups: dict[str, list[str]] = {}
    for opt, arity in sorted(table.items()):
        groups.setdefault(arity, []).append(opt)
    print("OPTIONS = {")
    for arity in sorted(groups):
        names = groups[arity]
        print(f"    # arity {arity}: {len(names)} options")
        print("    **dict.fromkeys(" + repr(names).replace("', '", "',\n        '") + f", {arity!r}),")
    print("}")
