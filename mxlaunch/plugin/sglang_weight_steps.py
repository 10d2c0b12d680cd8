"""SGLang's two weight steps, load then post-process, across its versions.

The restore needs them apart: a staged or P2P rank copies the snapshot in place of the load, then lets
SGLang post-process (quant repacking, AMX packing) as usual. SGLang 0.5.2x has them as two static methods of
DefaultModelLoader (`load_weights_only`, `postprocess_weights`); SGLang 0.5.16 (the H200 kit's, which pins the
GPU machine's torch) has one `load_weights_and_postprocess` doing both, so its halves are taken from that
method's body here: `model.load_weights` (under FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1 for nvfp4-online
quantization, as it does), then each module's `quant_method.process_weights_after_loading` inside
`device_loading_context`. The loader class and the context are passed in, so this runs under test without SGLang.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def load_only(loader_cls: Any, model: Any, weights: Any, target_device: Any) -> None:
    """SGLang's weight load without its post-processing."""
    own = getattr(loader_cls, "load_weights_only", None)
    if own is not None:
        own(model, weights, target_device)
        return
    if getattr(getattr(model, "quant_config", None), "is_nvfp4_online", False):
        with _env("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH", "1"):
            model.load_weights(weights)
    else:
        model.load_weights(weights)


def postprocess(loader_cls: Any, model: Any, target_device: Any, device_loading_context: Callable[..., Any]) -> None:
    """SGLang's post-processing of loaded weights (each quantized module's process_weights_after_loading)."""
    own = getattr(loader_cls, "postprocess_weights", None)
    if own is not None:
        own(model, target_device)
        return
    for _, module in model.named_modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            with device_loading_context(module, target_device):
                quant_method.process_weights_after_loading(module)
