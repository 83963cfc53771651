"""hp-tp's column/row-wise styles expose PyTorch's override points, so subclasses written for
PyTorch's styles work unchanged on hp-tp's.

Oracle: the same subclass body on torch's style under torch's ``parallelize_module``, bitwise.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed.tensor.parallel as torch_tp
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import hp_tp
from hp_dtensor.testing import distributed


def _with_overrides(base: type) -> type:
    """A subclass of ``base`` written against PyTorch's override points."""

    class Custom(base):  # type: ignore[misc, valid-type]
        calls: list[str]

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.calls = []

        def _partition_linear_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
            # Row-wise weight, bias kept replicated and frozen: a custom partition.
            self.calls.append("partition")
            weight = distribute_tensor(module.weight, mesh, [Shard(1)])
            module.register_parameter("weight", nn.Parameter(weight))
            bias = distribute_tensor(module.bias, mesh, [Replicate()])
            module.register_parameter("bias", nn.Parameter(bias, requires_grad=False))

        @staticmethod
        def _prepare_output_fn(
            output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, mesh: Any
        ) -> Any:
            out = base._prepare_output_fn(output_layouts, use_local_output, mod, outputs, mesh)
            return out * 2.0

    return Custom


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 18)
        self.down = nn.Linear(18, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@distributed(world_size=3)
def test_pytorch_style_subclass_runs_on_hp_styles_like_on_torchs() -> None:
    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(0)
    reference = _MLP()
    ours, theirs = copy.deepcopy(reference), copy.deepcopy(reference)
    hp_custom = _with_overrides(hp_tp.RowwiseParallel)()
    torch_custom = _with_overrides(torch_tp.RowwiseParallel)()
    hp_tp.parallelize_module(ours, mesh, {"up": hp_tp.ColwiseParallel(), "down": hp_custom})
    torch_tp.parallelize_module(
        theirs, mesh, {"up": torch_tp.ColwiseParallel(), "down": torch_custom}
    )
    assert hp_custom.calls == ["partition"] == torch_custom.calls
    assert ours.down.bias.placements == (Replicate(),)
    assert not ours.down.bias.requires_grad
    torch.manual_seed(5)
    x = torch.randn(4, 12)
    out, out_torch = ours(x), theirs(x)
    assert not isinstance(out, DTensor)
    assert torch.equal(out, out_torch)
    torch.testing.assert_close(out, 2.0 * reference(x), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    out_torch.sum().backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), name


@distributed(world_size=2)
def test_prepare_input_override_sees_every_forward() -> None:
    mesh = init_device_mesh("cpu", (2,))
    seen: list[tuple[Any, ...]] = []

    class Logged(hp_tp.ColwiseParallel):
        @staticmethod
        def _prepare_input_fn(
            input_layouts: Any, desired: Any, mod: nn.Module, inputs: Any, device_mesh: Any
        ) -> Any:
            seen.append((tuple(input_layouts), tuple(desired)))
            return hp_tp.ColwiseParallel._prepare_input_fn(
                input_layouts, desired, mod, inputs, device_mesh
            )

    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    expected = layer(torch.ones(2, 6))
    hp_tp.parallelize_module(layer, mesh, Logged(output_layouts=Replicate()))
    for _ in range(2):
        torch.testing.assert_close(layer(torch.ones(2, 6)), expected)
    assert seen == [((Replicate(),), (Replicate(),))] * 2


@distributed(world_size=2)
def test_tp_block_under_torch_compile_aot_eager_matches_eager() -> None:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    eager = _MLP()
    compiled = copy.deepcopy(eager)
    plan = {"up": hp_tp.ColwiseParallel(), "down": hp_tp.RowwiseParallel()}
    hp_tp.parallelize_module(eager, mesh, plan)
    hp_tp.parallelize_module(compiled, mesh, plan)
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(compiled, backend=backend)
    torch.manual_seed(3)
    x = torch.randn(4, 12)
    out, out_eager = fn(x), eager(x)
    torch.testing.assert_close(out, out_eager, rtol=1e-6, atol=1e-6)
    assert backend.frame_count >= 1  # Dynamo captured graphs: not everything ran eagerly
    out.square().sum().backward()
    out_eager.square().sum().backward()
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), msg=name)
