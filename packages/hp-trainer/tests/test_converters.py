"""The model-converter protocol (``--model.converters``).

- Names are checked when the configuration is parsed: an unknown or repeated name is refused
  with the list of known names; the built-ins are exactly ``float8``, ``mx``, ``lora``.
- The trainer builds the converters in the listed order, calls ``convert`` once on the whole,
  not yet parallelised model (before FSDP/TP: plain tensors), and ``post_optimizer_hook`` after
  every optimizer step with the model parts, each converter in order.
- ``register_model_converter`` refuses non-classes, classes without the hooks, taken names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hp_dtensor.testing import load_test_module
from hp_trainer import (
    ConfigManager,
    ModelConverter,
    Trainer,
    build_model_converters,
    register_model_converter,
)
from hp_trainer.components import converters as conv

_h = load_test_module(
    Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
)

EVENTS: list[tuple[Any, ...]] = []


class _Recorder:
    tag = "?"

    def __init__(self, job_config: Any, parallel_dims: Any) -> None:
        EVENTS.append(("init", self.tag, parallel_dims.world_size))

    def convert(self, model: nn.Module) -> None:
        plain = all(type(p.data) is torch.Tensor for p in model.parameters())
        n_layers = len(model.layers)  # type: ignore[arg-type]
        EVENTS.append(("convert", self.tag, plain, n_layers))
        # a visible effect: scale the output head (the trained model must carry it)
        with torch.no_grad():
            model.lm_head.weight.zero_()  # type: ignore[union-attr,operator]

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        assert isinstance(model, list)
        EVENTS.append(("post", self.tag, len(model)))


class _First(_Recorder):
    tag = "first"


class _Second(_Recorder):
    tag = "second"


@pytest.fixture
def registered() -> Any:
    register_model_converter(_First, "test_first")
    register_model_converter(_Second, "test_second")
    try:
        yield
    finally:
        conv._REGISTERED.pop("test_first", None)
        conv._REGISTERED.pop("test_second", None)
        EVENTS.clear()


def test_builtin_names_and_parse_time_refusal() -> None:
    assert conv._BUILTIN_CONVERTERS == {
        "float8": "hp_trainer.components.converters.float8:Float8Converter",
        "mx": "hp_trainer.components.converters.mx:MXConverter",
        "lora": "hp_trainer.components.converters.lora:LoRAConverter",
    }
    assert ConfigManager().parse_args(["--model.converters", "lora"]).model.converters == ["lora"]
    with pytest.raises(ValueError, match=r"unknown converter 'fp8'; known converters: float8, mx"):
        ConfigManager().parse_args(["--model.converters", "lora,fp8"])
    with pytest.raises(ValueError, match="'lora' is listed twice"):
        ConfigManager().from_dict({"model": {"converters": ["lora", "lora"]}})
    assert ConfigManager().parse_args([]).model.converters == []


def test_register_refusals(registered: Any) -> None:
    with pytest.raises(TypeError, match="expects a class"):
        register_model_converter(_First(None, type("D", (), {"world_size": 1})()), "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lacks convert, post_optimizer_hook"):
        register_model_converter(int, "x")
    with pytest.raises(ValueError, match="'lora' is already taken"):
        register_model_converter(_First, "lora")
    with pytest.raises(ValueError, match="'test_first' is already taken"):
        register_model_converter(_Second, "test_first")
    with pytest.raises(ValueError, match="without commas"):
        register_model_converter(_Second, "a,b")
    assert "test_first" in conv.model_converter_names()
    assert isinstance(_First(None, type("D", (), {"world_size": 1})()), ModelConverter)


def test_trainer_applies_converters_in_order(tmp_path: Path, registered: Any) -> None:
    EVENTS.clear()
    cfg = _h.job(tmp_path, {}, run="conv", steps=2)
    cfg.model.converters = ["test_second", "test_first"]
    trainer = Trainer(cfg)
    assert [type(c) for c in trainer.model_converters] == [_Second, _First]
    trainer.train()
    trainer.close()
    assert EVENTS == [
        ("init", "second", 1),
        ("init", "first", 1),
        ("convert", "second", True, 2),
        ("convert", "first", True, 2),
        ("post", "second", 1),
        ("post", "first", 1),
        ("post", "second", 1),
        ("post", "first", 1),
    ]
    # the conversion reached the trained model: the zeroed head moved by 2 AdamW steps only
    assert trainer.model.lm_head.weight.abs().max() < 0.05  # type: ignore[union-attr,operator]
    empty = build_model_converters(_h.job(tmp_path, {}, run="none"), trainer.parallel_dims)
    assert len(empty) == 0
