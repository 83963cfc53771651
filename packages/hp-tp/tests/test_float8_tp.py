"""torchao's Float8 tensor-parallel styles applied by ``hp_tp.parallelize_module`` (foreign styles).

A feed-forward block converted by ``torchao.float8.convert_to_float8_training`` (tensorwise
scaling) is parallelised with torchao's ``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and
``PrepareFloat8ModuleInput`` (the sequence-parallel input is cast to float8 before its
all-gather), next to hp-tp's own ``SequenceParallel`` for the norm; the oracle is the same
torchao plan (with torch's ``SequenceParallel``) applied by torch's ``parallelize_module``.
Under FSDP x TP 2x2 the data-parallel dimension is sharded by ``hp_fsdp.fully_shard`` (float8
all-gather of torchao's weight wrapper, precomputed scales) against torch's ``fully_shard``.
Losses, gradients and parameters after 3 AdamW steps must be bitwise equal; different data on
every data-parallel rank, and on every sequence shard.

gloo has no float8 all-gather ("Invalid scalar type"; NCCL sends float8 as bytes): torch's FSDP
is given a custom all-gather sending the same buffers as bytes (see hp-fsdp's
``test_float8_fsdp.py``), and both runs go through a dispatch mode that issues DTensor's float8
activation all-gathers (``PrepareFloat8ModuleInput``) on a ``uint8`` view of the same buffer.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.tensor.parallel as torch_tp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import hp_tp
from hp_dtensor.testing import distributed

float8 = pytest.importorskip("torchao.float8", reason="torchao (hp-trainer[float8]) not installed")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_tensor_parallel import (  # noqa: E402
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)
from torchao.float8.float8_training_tensor import Float8TrainingTensor  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

DIM, HIDDEN, SEQ = 48, 96, 12  # divisible by 16 (float8) and by 2 and 3 (shards)
STEPS = 3


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ff = _FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _BytesAllGather(AllGather):
    """torch's all-gather on the same buffers viewed as bytes (gloo lacks float8)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        return dist.all_gather_into_tensor(
            output_tensor.view(torch.uint8),
            input_tensor.view(torch.uint8),
            group=group,
            async_op=async_op,
        )


class _Float8AsBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Functional all-gathers of float8 tensors sent as bytes (gloo lacks float8).

    Counts them by dtype: the activations ``PrepareFloat8ModuleInput`` gathers in e4m3 in the
    forward, the output gradients ``Float8RowwiseParallel`` gathers in e5m2 in the backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self.float8_all_gathers: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, (DTensor, Float8TrainingTensor)) for t in types):
            return NotImplemented  # let the subclasses desugar into plain collectives first
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default and args[0].dtype in (
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        ):
            self.float8_all_gathers[str(args[0].dtype).removeprefix("torch.")] += 1
            out = func(args[0].view(torch.uint8), *args[1:], **kwargs)
            return torch.ops._c10d_functional.wait_tensor(out).view(args[0].dtype)
        return func(*args, **kwargs)


def _plan(ours: bool) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for i in range(2):
        plan[f"layers.{i}.norm"] = hp_tp.SequenceParallel() if ours else torch_tp.SequenceParallel()
        plan[f"layers.{i}.ff"] = PrepareFloat8ModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        plan[f"layers.{i}.ff.w1"] = Float8ColwiseParallel()
        plan[f"layers.{i}.ff.w3"] = Float8ColwiseParallel()
        plan[f"layers.{i}.ff.w2"] = Float8RowwiseParallel(output_layouts=Shard(1))
    return plan


def _build(ours: bool, tp: DeviceMesh, dp: DeviceMesh | None) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = _Net()
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=dp is not None)
    float8.convert_to_float8_training(model, config=config)
    (hp_tp if ours else torch_tp).parallelize_module(model, tp, _plan(ours))
    if dp is not None:
        import hp_fsdp

        shard = hp_fsdp.fully_shard if ours else torch_fsdp.fully_shard
        for layer in model.layers:
            shard(layer, mesh=dp)
        shard(model, mesh=dp)
        if not ours:
            for unit in (*model.layers, model):
                unit.set_custom_all_gather(_BytesAllGather())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _check(tp: DeviceMesh, dp: DeviceMesh | None) -> None:
    hp_model, hp_opt = _build(True, tp, dp)
    ref_model, ref_opt = _build(False, tp, dp)
    weights = [m.weight for m in hp_model.modules() if isinstance(m, Float8Linear)]
    assert len(weights) == 6
    for w, ref in zip(
        weights,
        [m.weight for m in ref_model.modules() if isinstance(m, Float8Linear)],
        strict=True,
    ):
        assert isinstance(w, DTensor)
        assert w.placements == ref.placements
        if dp is not None:  # FSDP's dim-0 shard over TP's shard; the float8 all-gather wrapper
            assert isinstance(w._local_tensor, WeightWithDynamicFloat8CastTensor)
    # different data per data-parallel rank and per sequence shard (tensor-parallel rank)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    for _ in range(STEPS):
        x = torch.randn(2, SEQ // tp.size(), DIM, generator=gen)
        losses, gathers = [], []
        for model in (hp_model, ref_model):
            with _Float8AsBytes() as mode:
                loss = model(x).square().mean()
                loss.backward()
            losses.append(loss.detach())
            gathers.append(mode.float8_all_gathers)
        assert torch.equal(losses[0], losses[1]), losses
        # per block: the activation in e4m3 (forward), the output gradient in e5m2 (backward)
        expected = {"float8_e4m3fn": 2, "float8_e5m2": 2}
        assert gathers == [expected, expected], gathers
        for (name, p_hp), (_, p_ref) in zip(
            hp_model.named_parameters(), ref_model.named_parameters(), strict=True
        ):
            assert torch.equal(p_hp.grad.to_local(), p_ref.grad.to_local()), name
        for model, opt in ((hp_model, hp_opt), (ref_model, ref_opt)):
            opt.step()
            opt.zero_grad()
            if dp is not None:
                float8.precompute_float8_dynamic_scale_for_fsdp(model)
    for (name, p_hp), (_, p_ref) in zip(
        hp_model.named_parameters(), ref_model.named_parameters(), strict=True
    ):
        assert torch.equal(p_hp.to_local(), p_ref.to_local()), name
    if dp is not None:  # precomputed on the 2-D (dp, tp) weights: amax over the whole weight
        fmax = torch.finfo(torch.float8_e4m3fn).max
        for w in weights:
            amax = w.full_tensor().abs().max().clamp(min=1e-12).double()
            assert torch.equal(w._local_tensor._precomputed_scale, (fmax / amax).float())


@distributed(world_size=4, timeout=240)
def test_float8_fsdp_x_tp_2x2_bitwise_with_torch() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _check(mesh["tp"], mesh["dp"])


@distributed(world_size=3, timeout=240)
def test_float8_tp3_styles_bitwise_with_torch() -> None:
    _check(init_device_mesh("cpu", (3,)), None)
