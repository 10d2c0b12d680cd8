"""What both option-table generators share (gen_vllm_flags.py, gen_sglang_flags.py): arities, OPTIONS."""

from __future__ import annotations

import argparse
from typing import Iterable


def arities(actions: Iterable[argparse.Action]) -> dict[str, str]:
    """option string → arity: "0" (no value; BooleanOptionalAction's --X and --no-X too), "1", "?", "*", "+"."""
    table: dict[str, str] = {}
    for action in actions:
        if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
            arity = "0"
        elif action.nargs is None:
            arity = "1"
        else:
            arity = str(action.nargs)
        for opt in action.option_strings:
            table[opt] = arity
    return table


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
