"""vLLM's online quantization (`--quantization fp8` and the other `uses_meta_device` methods) on the snapshot paths.

Online methods quantize *while* the weights load: each Linear is created with its bf16 weight on the meta
device, the engine buffers the checkpoint's tensors per layer and, once a layer has all of them, materializes
it, loads them and runs the method's post-processing on it (vLLM: model_loader/reload/layerwise.py). So after
the engine's weight loading — where the capture is taken — these layers already hold their processed tensors
(an fp8 `weight` and its `weight_scale`), while a freshly built model still has a meta bf16 weight and no
scale. A raw snapshot of such a model is restored by first bringing each of these layers to the same
processed layout on placeholder values — the engine's own step, as its dummy loader runs it — and then
landing every captured tensor over it (the restore's fill check: every tensor of the model filled exactly
once, by name, shape and dtype, nothing in the snapshot the model lacks). The engine's post-processing after
the restore skips these layers (they are marked processed), and processes the others as usual.

Sound only when the processed layer's state is all in its parameters and buffers: a tensor kept in a plain
attribute (`layer.x = tensor`) would still hold the placeholder's value after the restore. `hidden_tensors`
finds those; the capture refuses such a model and the restore refuses to serve one (a rebuild with the
default loader). A layer still holding buffered checkpoint tensors after the weight loading (loaded in part)
keeps them outside its parameters: the capture refuses that too.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

PLACEHOLDER = 1.0  # quantizes to finite values under every method (zeros give a zero scale)


def online_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules whose quantization method quantizes during weight loading (vLLM's `uses_meta_device`)."""
    for name, module in model.named_modules():
        if getattr(getattr(module, "quant_method", None), "uses_meta_device", False):
            yield name, module


def hidden_tensors(module: nn.Module) -> list[str]:
    """Tensors a module (or its quantization method) keeps outside its parameters and buffers: no snapshot
    holds them. nn.Module keeps registered ones in _parameters/_buffers; a plain `module.x = tensor` lands
    in the instance dict."""
    out = [k for k, v in vars(module).items() if isinstance(v, torch.Tensor)]
    method = getattr(module, "quant_method", None)
    if method is not None and hasattr(method, "__dict__"):
        out += [f"quant_method.{k}" for k, v in vars(method).items()
                if isinstance(v, torch.Tensor) and v.device.type != "meta"]
    return out


def _layerwise() -> Any:
    from vllm.model_executor.model_loader.reload import layerwise

    return layerwise


def _deferred_attention() -> Any:
    """The engine's test for layers its finalize step processes last (attention): vLLM 0.32 names it,
    vLLM 0.26 checks the classes inline."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        return is_deferred_attention_layer
    except ImportError:
        from vllm.model_executor.layers.attention import Attention, MLAAttention

        return lambda layer: isinstance(layer, (Attention, MLAAttention))


def capture_problem(model: nn.Module) -> str | None:
    """After the engine's weight loading: why this model's tensors do not hold its loaded state (None: they do)."""
    layers = list(online_layers(model))
    if not layers:
        return None
    try:
        layerwise = _layerwise()
    except ImportError as exc:
        return f"online quantization in a vLLM without the layerwise loader mxlaunch knows ({exc})"
    deferred = _deferred_attention()
    for name, layer in layers:
        info = layerwise.get_layerwise_info(layer)
        if info.can_load() and info.load_numel > 0:  # attention too: its checkpoint scales would be lost
            return (f"{name} holds {info.load_numel} of {info.load_numel_total} values in the engine's buffers, "
                    "outside the model (loaded in part, or left to the engine's finalize step)")
        if info.can_load() or deferred(layer):
            continue  # not processed yet: the engine's finalize step processes it after the capture, as after a restore
        hidden = hidden_tensors(layer)
        if hidden:
            return f"{name} keeps tensors outside its parameters and buffers after quantizing: {', '.join(hidden)}"
    return None


def prepare_restore(model: nn.Module) -> list[str]:
    """Bring each online-quantized layer still waiting for its weights to its processed layout on placeholder
    values (materialize → placeholder → the method's post-processing → marked done), as vLLM's dummy loader
    does. Returns the layers it processed; raises RuntimeError when a processed layer keeps hidden tensors.
    After this, the engine's default weight loading can no longer run on this model: a failure means a rebuild."""
    layers = [(n, m) for n, m in online_layers(model)]
    if not layers:
        return []
    layerwise = _layerwise()
    deferred = _deferred_attention()
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.meta import materialize_layer
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    done: list[str] = []
    for name, layer in layers:
        info = layerwise.get_layerwise_info(layer)
        if not info.can_load() or deferred(layer):
            continue  # processed already, or left to the engine's finalize step as in the capture run
        materialize_layer(layer, info)
        with torch.no_grad():
            for tensor in get_layer_tensors(layer).values():
                if tensor.is_floating_point():
                    tensor.data.fill_(PLACEHOLDER)
                else:
                    tensor.data.zero_()
        for tensor in get_layer_tensors(layer).values():
            tensor.weight_loader = layerwise._get_original_loader(tensor)
        method = getattr(layer, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(layer)
            if hasattr(layer, "update_param_tp_status"):
                layer.update_param_tp_status()
        info.reset()
        hidden = hidden_tensors(layer)
        if hidden:
            raise RuntimeError(f"{name} keeps tensors outside its parameters and buffers after quantizing: "
                               f"{', '.join(hidden)} (a snapshot cannot restore them)")
        done.append(name)
    return done
