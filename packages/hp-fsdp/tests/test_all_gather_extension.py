"""The fsdp_pre_all_gather / fsdp_post_all_gather tensor-subclass extension, against torch.

A frozen int8 weight with a per-row fp32 scale (a wrapper tensor subclass written here) is
all-gathered in its compact form (int8 data + scales) and dequantized after the all-gather.
hp-fsdp and torch's ``fully_shard`` train the same model side by side with different data on
every rank; outputs and the gradients of the trainable parameters must be bitwise equal.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import hp_fsdp
from hp_dtensor.testing import distributed, fake_world

aten = torch.ops.aten
ROWS, COLS = 6, 8  # 6 rows split evenly over 2 and 3 ranks


class Int8Scaled(torch.Tensor):
    """A float32-looking weight stored as int8 ``data`` with one fp32 ``scale`` per row."""

    data_i8: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, data_i8: torch.Tensor, scale: torch.Tensor) -> Int8Scaled:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, data_i8.shape, dtype=torch.float32, device=data_i8.device
        )

    def __init__(self, data_i8: torch.Tensor, scale: torch.Tensor) -> None:
        self.data_i8 = data_i8
        self.scale = scale
        #: Protocol calls seen by this instance: "pre", "post" (first) and "post_out".
        self.calls: list[str] = []

    def __repr__(self) -> str:
        return f"Int8Scaled(shape={tuple(self.shape)})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["data_i8", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], *_: Any) -> Int8Scaled:
        return Int8Scaled(inner["data_i8"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.copy_.default:
            dst, src = args
            dst.data_i8.copy_(src.data_i8)
            dst.scale.copy_(src.scale)
            return dst
        if func is aten.new_zeros.default:
            self, size = args[0], args[1]
            return Int8Scaled(self.data_i8.new_zeros(size), self.scale.new_zeros((size[0], 1)))
        if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            # A flat view keeps the per-row scales as they are (the view is not dequantized).
            return Int8Scaled(func(args[0].data_i8, *args[1:], **kwargs), args[0].scale)
        if func in (
            aten.split.Tensor,
            aten.narrow.default,
            aten.slice.Tensor,
            aten.detach.default,
            aten.alias.default,
            aten.clone.default,
        ):
            dim = args[2] if func is aten.split.Tensor and len(args) > 2 else 0
            if func in (aten.narrow.default, aten.slice.Tensor):
                dim = args[1] if len(args) > 1 else 0
            if dim not in (0, -2):
                raise NotImplementedError(f"Int8Scaled: {func} on dim {dim}")
            data = func(args[0].data_i8, *args[1:], **kwargs)
            scale = func(args[0].scale, *args[1:], **kwargs)
            if isinstance(data, (list, tuple)):
                return [Int8Scaled(d, s) for d, s in zip(data, scale, strict=True)]
            return Int8Scaled(data, scale)
        if func is aten._to_copy.default and kwargs.get("dtype") in (None, torch.float32):
            return args[0]
        if func in (aten.is_same_size.default,):
            return args[0].shape == args[1].shape
        raise NotImplementedError(f"Int8Scaled does not support {func}")

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        self.calls.append("pre")
        return (self.data_i8, self.scale), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        data, scale = all_gather_outputs
        self.calls.append("post" if out is None else "post_out")
        if out is not None:
            torch.mul(data.to(param_dtype), scale, out=out)
            return None
        dequantized = torch.empty(data.shape, dtype=param_dtype, device=data.device)
        torch.mul(data.to(param_dtype), scale, out=dequantized)
        return dequantized, (dequantized,)


def _quantize(weight: torch.Tensor) -> Int8Scaled:
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    data = torch.round(weight / scale).clamp(-127, 127).to(torch.int8)
    return Int8Scaled(data, scale)


class _QuantMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qweight = nn.Parameter(_quantize(torch.randn(ROWS, COLS)), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(ROWS))
        self.out = nn.Linear(ROWS, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(F.linear(x, self.qweight, self.bias)))


def _build(shard: Any, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _QuantMLP()
    shard(model.out, mesh=mesh)
    shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.SGD(trainable, lr=0.1)


def _check_parity() -> None:
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    hp_model, hp_opt = _build(hp_fsdp.fully_shard, mesh)
    ref_model, ref_opt = _build(torch_fsdp.fully_shard, mesh)
    hp_q = hp_model.qweight._local_tensor
    assert isinstance(hp_q, Int8Scaled)
    assert hp_q.data_i8.shape == (ROWS // ws, COLS)  # sharded compact, not dequantized
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # different data per rank
    for _ in range(3):
        x = torch.randn(5, COLS, generator=gen)
        outs = []
        for model in (hp_model, ref_model):
            y = model(x)
            y.square().sum().backward()
            outs.append(y.detach())
        assert torch.equal(outs[0], outs[1])
        for (name, p_hp), (_, p_ref) in zip(
            hp_model.named_parameters(), ref_model.named_parameters(), strict=True
        ):
            if not p_hp.requires_grad:
                assert p_hp.grad is None
                assert p_ref.grad is None
                continue
            assert torch.equal(p_hp.grad.to_local(), p_ref.grad.to_local()), name
        for opt in (hp_opt, ref_opt):
            opt.step()
            opt.zero_grad()
    # The same protocol calls as torch: one pre/post per all-gather (forward, and again in
    # backward after resharding), ``out=`` from the second all-gather on.
    ref_q = ref_model.qweight._local_tensor
    assert isinstance(ref_q, Int8Scaled)
    assert hp_q.calls == ref_q.calls
    assert hp_q.calls[:4] == ["pre", "post", "pre", "post_out"], hp_q.calls
    # Resharded after backward: the sharded int8 weight is registered again.
    assert hp_model.qweight._local_tensor is hp_q


@distributed(world_size=2, timeout=120)
def test_int8_subclass_bitwise_parity_with_torch_ws2() -> None:
    _check_parity()


@distributed(world_size=3, timeout=120)
def test_int8_subclass_bitwise_parity_with_torch_ws3() -> None:
    _check_parity()


def test_subclass_with_only_one_hook_refused() -> None:
    class _Half(torch.Tensor):
        def fsdp_pre_all_gather(self, *args: Any) -> Any:
            raise AssertionError("never called")

    module = nn.Linear(4, 4)
    module.weight = nn.Parameter(torch.randn(4, 4).as_subclass(_Half))
    with fake_world(2, rank=0), pytest.raises(AssertionError, match="needs both methods"):
        hp_fsdp.fully_shard(module, mesh=init_device_mesh("cpu", (2,)))
