"""SGLang's load / post-process split across versions (plugin/sglang_weight_steps.py), with fake models."""

from __future__ import annotations

import contextlib
import os

from mxlaunch.plugin import sglang_weight_steps as steps


class Quant:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def process_weights_after_loading(self, module: object) -> None:
        self.calls.append(("process", module.name))


class Module:
    def __init__(self, name: str, calls: list, quant: bool) -> None:
        self.name = name
        self.quant_method = Quant(calls) if quant else None


class Model:
    def __init__(self, nvfp4_online: bool = False) -> None:
        self.calls: list = []
        self.quant_config = type("Q", (), {"is_nvfp4_online": nvfp4_online})()
        self.modules = [Module("a", self.calls, True), Module("b", self.calls, False), Module("c", self.calls, True)]

    def load_weights(self, weights: object) -> None:
        self.calls.append(("load", list(weights), os.environ.get("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH")))

    def named_modules(self):
        return [(m.name, m) for m in self.modules]


class OldLoader:  # SGLang 0.5.16: one method did both steps
    @staticmethod
    def load_weights_and_postprocess(model, weights, target_device):  # pragma: no cover - never called
        raise AssertionError("the split steps must not call the combined method")


class NewLoader:  # SGLang 0.5.2x: the steps are its own
    seen: list = []

    @staticmethod
    def load_weights_only(model, weights, target_device):
        NewLoader.seen.append(("load_only", target_device))

    @staticmethod
    def postprocess_weights(model, target_device):
        NewLoader.seen.append(("postprocess", target_device))


def context(calls: list):
    @contextlib.contextmanager
    def device_loading_context(module, target_device):
        calls.append(("enter", module.name, target_device))
        yield
        calls.append(("exit", module.name))
    return device_loading_context


def test_old_sglang_loads_without_postprocessing_then_postprocesses_each_quantized_module() -> None:
    model = Model()
    steps.load_only(OldLoader, model, iter([("w", 1)]), "cuda")
    assert model.calls == [("load", [("w", 1)], None)]
    steps.postprocess(OldLoader, model, "cuda", context(model.calls))
    assert model.calls[1:] == [("enter", "a", "cuda"), ("process", "a"), ("exit", "a"),
                               ("enter", "c", "cuda"), ("process", "c"), ("exit", "c")]


def test_old_sglang_nvfp4_online_loads_with_exact_fp4_math_and_restores_the_environment() -> None:
    os.environ.pop("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH", None)
    model = Model(nvfp4_online=True)
    steps.load_only(OldLoader, model, iter([]), "cuda")
    assert model.calls == [("load", [], "1")]
    assert "FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH" not in os.environ


def test_new_sglang_steps_are_its_own() -> None:
    NewLoader.seen.clear()
    model = Model()
    steps.load_only(NewLoader, model, iter([]), "dev")
    steps.postprocess(NewLoader, model, "dev", context(model.calls))
    assert NewLoader.seen == [("load_only", "dev"), ("postprocess", "dev")] and model.calls == []
