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
from torch.distributed.tensor import DTensor, Replicate, Shard

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


class ScaledCompact(torch.Tensor):
    """A trainable float32 weight all-gathered as bfloat16 and scaled on use.

    The sharded parameter keeps float32 ``data`` (what the optimizer updates); the all-gather
    sends it as bfloat16 (padded to the padded sharded size for an uneven shard, as torch
    requires) and ``fsdp_post_all_gather`` returns ``float(gathered) * scale``: a plain tensor
    that becomes the unsharded parameter, so its gradient is reduced like any other.
    """

    data_f32: torch.Tensor
    scale: float

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: float) -> ScaledCompact:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, data.shape, dtype=torch.float32, device=data.device
        )

    def __init__(self, data: torch.Tensor, scale: float) -> None:
        self.data_f32 = data
        self.scale = scale
        #: (call, mesh size) of each protocol call seen by this instance.
        self.calls: list[tuple[str, int]] = []

    def __repr__(self) -> str:
        return f"ScaledCompact(shape={tuple(self.shape)})"

    def __tensor_flatten__(self) -> tuple[list[str], float]:
        return ["data_f32"], self.scale

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], scale: float, *_: Any) -> Any:
        return ScaledCompact(inner["data_f32"], scale)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self = args[0]

        def unwrap(t: Any) -> Any:
            return t.data_f32 if isinstance(t, ScaledCompact) else t

        if func is aten.copy_.default:
            self.data_f32.copy_(unwrap(args[1]))
            return self
        if func in (aten.add_.Tensor, aten.mul_.Tensor, aten.sub_.Tensor):  # optimizer updates
            func(self.data_f32, *map(unwrap, args[1:]), **kwargs)
            return self
        if func is aten.new_zeros.default:
            return ScaledCompact(self.data_f32.new_zeros(args[1]), self.scale)
        if func is aten.is_same_size.default:
            return args[0].shape == args[1].shape
        if func is aten._to_copy.default and kwargs.get("dtype") in (None, torch.float32):
            return ScaledCompact(func(self.data_f32, **kwargs), self.scale)
        if func in (
            aten.view.default,
            aten._unsafe_view.default,
            aten.reshape.default,
            aten.split.Tensor,
            aten.narrow.default,
            aten.slice.Tensor,
            aten.detach.default,
            aten.alias.default,
            aten.clone.default,
        ):
            out = func(self.data_f32, *args[1:], **kwargs)
            if isinstance(out, (list, tuple)):
                return [ScaledCompact(t, self.scale) for t in out]
            return ScaledCompact(out, self.scale)
        raise NotImplementedError(f"ScaledCompact does not support {func}")

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor], None]:
        self.calls.append(("pre", mesh.size()))
        data = self.data_f32
        padded_rows = -(-outer_size[0] // mesh.size())
        if data.size(0) < padded_rows:  # an uneven dim-0 shard: send the padded size
            padded = data.new_zeros(padded_rows, *data.shape[1:])
            padded[: data.size(0)] = data
            data = padded
        return (data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        (gathered,) = all_gather_outputs
        self.calls.append(("post" if out is None else "post_out", 0))
        if out is not None:  # the gathered rows may include padding past the parameter
            if isinstance(out, DTensor):  # a tensor-parallel parameter's unsharded DTensor
                out = out._local_tensor
            flat = gathered.reshape(-1)[: out.numel()].view(out.shape)
            with torch.no_grad():
                torch.mul(flat.to(param_dtype), self.scale, out=out)
            return None
        unsharded = gathered.to(param_dtype) * self.scale
        return unsharded, (unsharded,)


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


class _CompactMLP(nn.Module):
    """A trainable ScaledCompact weight (``rows`` rows), optionally beside a frozen int8 one."""

    def __init__(self, rows: int, with_int8: bool) -> None:
        super().__init__()
        self.cweight = nn.Parameter(ScaledCompact(torch.randn(rows, COLS), 0.5))
        self.bias = nn.Parameter(torch.randn(rows))
        self.qweight: nn.Parameter | None = None
        if with_int8:
            self.qweight = nn.Parameter(_quantize(torch.randn(ROWS, COLS)), requires_grad=False)
        self.out = nn.Linear(rows + (ROWS if with_int8 else 0), 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.cweight, self.bias)
        if self.qweight is not None:
            h = torch.cat([h, F.linear(x, self.qweight)], dim=-1)
        return self.out(torch.relu(h))


def _inner(local: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a local shard's values (a subclass's inner data)."""
    if isinstance(local, ScaledCompact):
        return local.data_f32
    if isinstance(local, Int8Scaled):
        return local.data_i8
    return local


def _check_trainable_parity(
    mesh: Any,
    rows: int,
    with_int8: bool,
    shard_dim: int = 0,
    replicate: bool = False,
    bf16: bool = False,
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """hp-fsdp vs torch FSDP2 (or both ``replicate``) on a _CompactMLP: outputs, gradients and
    parameters after 3 SGD steps bitwise equal. Returns both runs' protocol calls on the
    compact weight."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate

    def placement(param: nn.Parameter) -> Shard | None:
        return Shard(shard_dim) if isinstance(param, ScaledCompact) else None

    def build(shard: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = _CompactMLP(rows, with_int8)
        policy: dict[str, Any] = {}
        if bf16:  # the subclass gets param_dtype in fsdp_post_all_gather
            mp = hp_fsdp if shard is hp_fsdp.fully_shard else torch_fsdp
            policy["mp_policy"] = mp.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        shard(model.out, mesh=mesh, **policy)
        if replicate:
            shard(model, mesh=mesh, **policy)
        else:
            shard(model, mesh=mesh, shard_placement_fn=placement, **policy)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.SGD(trainable, lr=0.1)

    if replicate:
        hp_model, hp_opt = build(hp_fsdp.replicate)
        ref_model, ref_opt = build(torch_replicate)
    else:
        hp_model, hp_opt = build(hp_fsdp.fully_shard)
        ref_model, ref_opt = build(torch_fsdp.fully_shard)
    assert hp_model.cweight.placements == ref_model.cweight.placements
    if not replicate:
        assert hp_model.cweight.placements[-1] == Shard(shard_dim)
    hp_c = hp_model.cweight._local_tensor
    assert isinstance(hp_c, ScaledCompact)
    assert hp_c.shape == ref_model.cweight._local_tensor.shape
    if with_int8:  # sharded over the shard axis only (HSDP: 2 of the 4 ranks)
        shard_size = mesh.size(mesh.ndim - 1)
        for model in (hp_model, ref_model):
            assert model.qweight._local_tensor.data_i8.shape == (ROWS // shard_size, COLS)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # different data per rank
    for step in range(3):
        x = torch.randn(5, COLS, generator=gen)
        outs = []
        for model in (hp_model, ref_model):
            y = model(x)
            y.square().sum().backward()
            outs.append(y.detach())
        assert torch.equal(outs[0], outs[1]), step
        assert outs[0].dtype == (torch.bfloat16 if bf16 else torch.float32)
        for (name, p_hp), (_, p_ref) in zip(
            hp_model.named_parameters(), ref_model.named_parameters(), strict=True
        ):
            if p_hp.requires_grad:
                assert torch.equal(p_hp.grad.to_local(), p_ref.grad.to_local()), (step, name)
        for opt in (hp_opt, ref_opt):
            opt.step()
            opt.zero_grad()
        for (name, p_hp), (_, p_ref) in zip(
            hp_model.named_parameters(), ref_model.named_parameters(), strict=True
        ):
            hp_local, ref_local = _inner(p_hp.to_local()), _inner(p_ref.to_local())
            assert torch.equal(hp_local, ref_local), (step, name)
    # The optimizer updated the subclass's float32 data in place (the parameter stayed one).
    assert hp_model.cweight._local_tensor is hp_c
    # torch re-pads an uneven shard at lazy init (a new instance): read the calls from the
    # instances registered now.
    ref_c = ref_model.cweight._local_tensor
    assert isinstance(ref_c, ScaledCompact)
    return hp_c.calls, ref_c.calls


@distributed(world_size=3, timeout=120)
def test_trainable_subclass_uneven_dim0_bitwise_with_torch_ws3() -> None:
    mesh = init_device_mesh("cpu", (3,))
    hp_calls, ref_calls = _check_trainable_parity(mesh, rows=7, with_int8=False)  # 3, 3, 1 rows
    assert hp_calls == ref_calls, (hp_calls, ref_calls)
    assert hp_calls[:4] == [("pre", 3), ("post", 0), ("pre", 3), ("post_out", 0)]
    # bf16 compute, fp32 reduction: the subclass builds a bf16 unsharded parameter
    hp_calls, ref_calls = _check_trainable_parity(mesh, rows=7, with_int8=False, bf16=True)
    assert hp_calls == ref_calls


@distributed(world_size=2, timeout=120)
def test_trainable_subclass_sharded_on_dim1_bitwise_with_torch_ws2() -> None:
    mesh = init_device_mesh("cpu", (2,))
    hp_calls, ref_calls = _check_trainable_parity(mesh, rows=5, with_int8=True, shard_dim=1)
    assert hp_calls == ref_calls


@distributed(world_size=4, timeout=120)
def test_subclasses_hsdp_2x2_bitwise_with_torch() -> None:
    """HSDP: the extension all-gathers over the shard axis only (its mesh has 2 ranks) and the
    trainable subclass's gradient is reduce-scattered, then all-reduced, as torch does."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hp_calls, ref_calls = _check_trainable_parity(mesh, rows=5, with_int8=True)  # 3, 2 rows
    assert hp_calls == ref_calls
    assert {size for call, size in hp_calls if call == "pre"} == {2}


@distributed(world_size=2, timeout=120)
def test_trainable_subclass_replicate_bitwise_with_torch_ws2() -> None:
    """``replicate``: the subclass's inputs are copied as a one-rank all-gather (torch's
    ``replicate`` passes the whole replicate mesh to ``fsdp_pre_all_gather``)."""
    mesh = init_device_mesh("cpu", (2,))
    hp_calls, ref_calls = _check_trainable_parity(mesh, rows=5, with_int8=False, replicate=True)
    assert hp_calls == ref_calls
    assert hp_calls[:2] == [("pre", 2), ("post", 0)]


class _TPCompactMLP(nn.Module):
    """A column-parallel ScaledCompact weight (a DTensor on the TP mesh) and a plain head."""

    def __init__(self, tp_mesh: Any, rows: int) -> None:
        super().__init__()
        self.tp_mesh = tp_mesh
        full = torch.randn(rows, COLS)
        local = full.chunk(tp_mesh.size(), 0)[tp_mesh.get_local_rank()].clone()
        self.cweight = nn.Parameter(
            DTensor.from_local(ScaledCompact(local, 0.5), tp_mesh, [Shard(0)], run_check=False)
        )
        self.out = nn.Linear(rows, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(DTensor.from_local(x, self.tp_mesh, [Replicate()]), self.cweight)
        return self.out(torch.relu(h.full_tensor()))


@distributed(world_size=4, timeout=120)
def test_trainable_subclass_as_dtensor_local_fsdp_x_tp_bitwise_with_torch() -> None:
    """FSDP over tensor parallelism: the subclass is a DTensor's local tensor (6 rows over TP 2,
    then 3 rows over DP 2: an uneven DP shard); 3 SGD steps bitwise equal to torch."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]

    def build(shard: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = _TPCompactMLP(tp_mesh, rows=6)
        shard(model.out, mesh=dp_mesh)
        shard(model, mesh=dp_mesh)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    hp_model, hp_opt = build(hp_fsdp.fully_shard)
    ref_model, ref_opt = build(torch_fsdp.fully_shard)
    assert hp_model.cweight.placements == ref_model.cweight.placements
    assert hp_model.cweight.placements[1] == Shard(0)  # DP: a strided shard of the TP shard
    hp_c = hp_model.cweight._local_tensor
    assert isinstance(hp_c, ScaledCompact)
    gen = torch.Generator().manual_seed(100 + dp_mesh.get_local_rank())  # same over TP ranks
    for step in range(3):
        x = torch.randn(5, COLS, generator=gen)
        outs = [m(x) for m in (hp_model, ref_model)]
        for y in outs:
            y.square().sum().backward()
        assert torch.equal(outs[0].detach(), outs[1].detach()), step
        for (name, p_hp), (_, p_ref) in zip(
            hp_model.named_parameters(), ref_model.named_parameters(), strict=True
        ):
            assert torch.equal(p_hp.grad.to_local(), p_ref.grad.to_local()), (step, name)
        for opt in (hp_opt, ref_opt):
            opt.step()
            opt.zero_grad()
        for (name, p_hp), (_, p_ref) in zip(
            hp_model.named_parameters(), ref_model.named_parameters(), strict=True
        ):
            assert torch.equal(_inner(p_hp.to_local()), _inner(p_ref.to_local())), (step, name)
    ref_c = ref_model.cweight._local_tensor
    assert hp_model.cweight._local_tensor is hp_c
    assert hp_c.calls == ref_c.calls
    assert hp_c.calls[:2] == [("pre", 2), ("post", 0)]
