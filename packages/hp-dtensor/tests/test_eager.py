"""hp_dtensor._eager.run_eagerly: a graph break under torch.compile, the plain function outside,
and no Dynamo import where nothing compiles."""

from __future__ import annotations

import subprocess
import sys

import torch

from hp_dtensor._eager import run_eagerly

_calls: list[str] = []


def _side_effect(x: torch.Tensor) -> torch.Tensor:
    _calls.append("ran")  # a Python side effect a traced graph would not replay
    return x.sin()


_hidden = run_eagerly(_side_effect, reason="test")


def test_outside_dynamo_it_is_the_function() -> None:
    _calls.clear()
    x = torch.randn(3)
    assert torch.equal(_hidden(x), x.sin())
    assert _calls == ["ran"]
    assert _hidden.__wrapped__ is _side_effect  # type: ignore[attr-defined]
    assert _hidden.__name__ == "_side_effect"


def test_under_compile_it_runs_eagerly_between_graphs() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    def fn(x: torch.Tensor) -> torch.Tensor:
        return _hidden(x.cos()) + 1

    compiled = torch.compile(fn, backend=backend)
    _calls.clear()
    x = torch.randn(4)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), x.cos().sin() + 1)
    assert _calls == ["ran"] * 3  # the body ran eagerly every call
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes}
    assert not any("sin" in t for t in targets), targets  # never traced into a graph
    assert any("cos" in t for t in targets), targets  # the code around it was compiled
    # the same with the plain function would trace sin and run the side effect once
    torch._dynamo.reset()


def test_importing_hp_dtensor_does_not_import_dynamo() -> None:
    """torch._dynamo and torch._inductor cost ~1.6 CPU s per process (every rank, every
    launcher); hp-trainer's package test checks the whole stack the same way."""
    code = (
        "import sys\n"
        "import hp_dtensor, hp_dtensor.testing\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
