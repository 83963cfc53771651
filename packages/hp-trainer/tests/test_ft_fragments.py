"""Fault tolerance: DiLoCo fragments by module name (``module_fqns_per_model_fragment``) and the
``should_quantize`` switch (TorchTitan's names), checked without a lighthouse."""

from __future__ import annotations

import pytest
import torch

from hp_trainer.components.ft.manager import _named_fragments, _split_fragments
from hp_trainer.config import ConfigManager, FaultToleranceConfig
from hp_trainer.protocols.model_spec import get_model_spec

FT = {"enable": True, "group_size": 2, "semi_sync_method": "diloco"}


def _model() -> torch.nn.Module:
    spec = get_model_spec("llama3")
    return spec.model_cls(spec.flavors["tiny"])


def _names(fragments: list[torch.nn.Module]) -> list[list[int]]:
    return [[id(p) for p in f.parameters()] for f in fragments]


def test_named_fragments_equal_the_sliced_ones_for_the_same_partition() -> None:
    model = _model()
    blocks = [f"layers.{name}" for name, _ in model.layers.named_children()]
    others = [name for name, _ in model.named_children() if name != "layers"]
    half = len(blocks) // 2
    fqns = [[others[0], *blocks[:half]], [*blocks[half:], *others[1:]]]
    named = _named_fragments(model, fqns)
    assert _names(named) == _names(_split_fragments(model, 2))
    # another partition: each parameter in exactly one fragment, none left out
    odd = [[others[0], *blocks[::2]], [*blocks[1::2], *others[1:]]]
    params = [p for f in _named_fragments(model, odd) for p in f.parameters()]
    assert sorted(map(id, params)) == sorted(id(p) for p in model.parameters())


def test_named_fragments_refuse_unknown_overlapping_and_missing() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"no module named \['layers\.99'\]"):
        _named_fragments(model, [["layers.99"]])
    everything = [name for name, _ in model.named_children()]
    with pytest.raises(ValueError, match="in fragments 0 and 1"):
        _named_fragments(model, [everything, ["layers.0"]])
    with pytest.raises(ValueError, match="leaves parameters in no fragment"):
        _named_fragments(model, [["layers.0"]])


def test_fragment_and_quantize_options_checked_at_parse_time() -> None:
    cfg = FaultToleranceConfig(**FT, module_fqns_per_model_fragment=[["a"], ["b"]])
    assert cfg.module_fqns_per_model_fragment == [["a"], ["b"]]
    with pytest.raises(ValueError, match="module_fqns_per_model_fragment"):
        FaultToleranceConfig(**FT, module_fqns_per_model_fragment=[["a"], []])
    with pytest.raises(ValueError, match="num_fragments 1 or 2"):
        FaultToleranceConfig(**FT, module_fqns_per_model_fragment=[["a"], ["b"]], num_fragments=3)
    with pytest.raises(ValueError, match="semi_sync_method = 'diloco'"):
        FaultToleranceConfig(enable=True, group_size=2, module_fqns_per_model_fragment=[["a"]])
    with pytest.raises(ValueError, match=r"should_quantize.*'gloo'"):
        FaultToleranceConfig(**FT, should_quantize=True)
    assert FaultToleranceConfig(**FT, should_quantize=True, process_group="nccl").should_quantize
    with pytest.raises(ValueError, match="should_quantize"):
        ConfigManager().parse_args(
            ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2",
             "--fault_tolerance.should_quantize", "true"]
        )  # fmt: skip
