"""Test-only stand-in for SGLang's compiled `sgl_kernel` package, so SGLang 0.5.23 serves on a CPU here.

SGLang's CPU path imports these eight names at module load (KV-slot bookkeeping and speculative
decoding) and calls none of them for a dense model without speculative decoding; every compiled CPU
kernel sits behind an AMX check that is false on this machine, so layers run plain torch. Each stub
raises if it is ever called: a test that reached one would fail loudly instead of serving wrong numbers.
Never shipped: it lives under tests/ and only the SGLang test helpers put it on PYTHONPATH.
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0+mxlaunch-test-shim"

_NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)


def _stub(name: str) -> Any:
    def called(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise RuntimeError(f"sgl_kernel.{name} was called, but this is mxlaunch's test-only shim "
                           "(no compiled kernels): the test took a path the shim does not cover")

    called.__name__ = name
    return called


for _name in _NAMES:
    globals()[_name] = _stub(_name)

__all__ = list(_NAMES)
