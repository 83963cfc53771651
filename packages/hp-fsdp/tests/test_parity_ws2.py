"""Bitwise parity with torch's fully_shard and the single-process oracle at world size 2."""

from __future__ import annotations

from pathlib import Path
import importlib.util, sys

from hp_dtensor.testing import distributed


def _h():
    name = "hp_fsdp_tests_helpers"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_fsdp_helpers.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@distributed(world_size=2)
def test_fp32_parity_ws2() -> None:
    h = _h()
    h.run_parity(h.Config(mesh_shape=(2,), steps=3))
