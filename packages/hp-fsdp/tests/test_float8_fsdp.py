"""torchao Float8 training under hp-fsdp, against the same torchao model under torch's FSDP2.

The model is converted by ``torchao.float8.convert_to_float8_training`` (the output head is
filtered out) and sharded once by ``hp_fsdp.fully_shard`` and once by torch's ``fully_shard``;
both train 3 AdamW steps side by side with different data on every rank. Tensorwise scaling
with ``enable_fsdp_float8_all_gather`` all-gathers torchao's weight wrapper
(``WeightWithDynamicFloat8CastTensor``, used unmodified) in float8 through the
``fsdp_pre_all_gather``/``fsdp_post_all_gather`` protocol;
``precompute_float8_dynamic_scale_for_fsdp`` runs after each optimizer step on the hp-sharded
model. Losses, gradients and parameters must be bitwise equal at FSDP 2 and 3 and HSDP 2x2,
tensorwise and rowwise.

gloo has no float8 all-gather ("Invalid scalar type"); hp-fsdp sends a tensor subclass's inputs
as raw bytes, torch sends them in their own dtype, so the torch oracle is given a custom
all-gather (``set_custom_all_gather``) that sends the same buffers viewed as ``uint8``: the
same bits travel, as on NCCL (which sends float8 as bytes).

A dispatch mode counts the collectives and their bytes: the float8 weights all-gather 1 byte
per element (a quarter of the fp32 model's bytes for those weights), and their scales travel
as one fp32 all-reduce (with precomputed scales: one per step for all weights).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import hp_fsdp
from hp_dtensor.testing import distributed

float8 = pytest.importorskip("torchao.float8", reason="torchao (hp-trainer[float8]) not installed")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

# float8 linears need dimensions divisible by 16; torchao's float8 all-gather also needs the
# rows to divide evenly over the shard ranks (its wrapper gathers the unpadded shard, which
# PyTorch and hp-fsdp refuse for an uneven shard): 48 and 96 divide by 2, 3 and 4.
DIM, HIDDEN, OUT = 48, 96, 16
STEPS = 3


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_FeedForward(), _FeedForward()])
        self.head = nn.Linear(DIM, OUT)  # filtered: stays a plain fp32 linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


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


class _CollectiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts collectives (c10d's and the functional ones DTensor issues) and their bytes.

    All-reduces are counted under ``all_reduce`` whichever API issued them. An op on DTensors is
    first left to DTensor (``NotImplemented``), so the collectives it desugars into are seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = func._schema.name
        namespace, _, op = name.partition("::")
        if namespace in ("c10d", "_c10d_functional") and op != "wait_tensor":
            op = "all_reduce" if op in ("allreduce_", "all_reduce") else op
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.calls[op] += 1
            self.bytes[op] += first.numel() * first.element_size()
        return func(*args, **(kwargs or {}))


def _config(recipe: str) -> Any:
    if recipe == "tensorwise":
        return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return float8.Float8LinearConfig.from_recipe_name(recipe)


def _build(
    shard: Any, mesh: DeviceMesh, recipe: str | None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Net()
    if recipe is not None:
        float8.convert_to_float8_training(
            model, config=_config(recipe), module_filter_fn=lambda _m, fqn: fqn != "head"
        )
    for layer in model.layers:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    if shard is torch_fsdp.fully_shard and recipe == "tensorwise":
        for unit in (*model.layers, model):
            unit.set_custom_all_gather(_BytesAllGather())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _float8_weights(model: nn.Module) -> list[DTensor]:
    return [m.weight for m in model.modules() if isinstance(m, Float8Linear)]


def _check_parity(mesh: DeviceMesh, recipe: str, precompute: bool) -> None:
    hp_model, hp_opt = _build(hp_fsdp.fully_shard, mesh, recipe)
    ref_model, ref_opt = _build(torch_fsdp.fully_shard, mesh, recipe)
    weights = _float8_weights(hp_model)
    assert len(weights) == 6  # w1, w3, w2 of both layers; the head is filtered
    for w in weights:
        assert isinstance(w, DTensor)
        wrapped = isinstance(w._local_tensor, WeightWithDynamicFloat8CastTensor)
        assert wrapped == (recipe == "tensorwise")  # rowwise gathers the plain weight
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())  # different data per rank
    for _ in range(STEPS):
        x = torch.randn(4, 8, DIM, generator=gen)
        losses = []
        for model in (hp_model, ref_model):
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), losses
        for (name, p_hp), (_, p_ref) in zip(
            hp_model.named_parameters(), ref_model.named_parameters(), strict=True
        ):
            assert torch.equal(p_hp.grad.to_local(), p_ref.grad.to_local()), name
        for model, opt in ((hp_model, hp_opt), (ref_model, ref_opt)):
            opt.step()
            opt.zero_grad()
            if precompute:
                float8.precompute_float8_dynamic_scale_for_fsdp(model)
    for (name, p_hp), (_, p_ref) in zip(
        hp_model.named_parameters(), ref_model.named_parameters(), strict=True
    ):
        assert torch.equal(p_hp.to_local(), p_ref.to_local()), name
    if precompute:  # the scale is finfo.max / amax over the whole (unsharded) weight
        fmax = torch.finfo(torch.float8_e4m3fn).max
        for w in weights:
            amax = w.full_tensor().abs().max().clamp(min=1e-12).double()
            expected = (fmax / amax).float()
            assert torch.equal(w._local_tensor._precomputed_scale, expected)


@distributed(world_size=2, timeout=180)
@pytest.mark.parametrize("precompute", [True, False])
def test_float8_tensorwise_all_gather_bitwise_with_torch_fsdp2_ws2(precompute: bool) -> None:
    _check_parity(init_device_mesh("cpu", (2,)), "tensorwise", precompute)


@distributed(world_size=3, timeout=180)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_bitwise_with_torch_fsdp2_ws3(recipe: str) -> None:
    _check_parity(init_device_mesh("cpu", (3,)), recipe, precompute=recipe == "tensorwise")


@distributed(world_size=4, timeout=180)
def test_float8_tensorwise_bitwise_with_torch_hsdp_2x2() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _check_parity(mesh, "tensorwise", precompute=True)


def _step_bytes(recipe: str | None, precompute: bool) -> tuple[Counter[str], Counter[str]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, opt = _build(hp_fsdp.fully_shard, mesh, recipe)
    x = torch.randn(4, 8, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):  # the second step is counted (first all-gathers allocate)
        counter = _CollectiveBytes()
        with counter:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if precompute:
                float8.precompute_float8_dynamic_scale_for_fsdp(model)
    return counter.calls, counter.bytes


@distributed(world_size=2, timeout=180)
def test_float8_all_gather_bytes_are_a_quarter_of_fp32() -> None:
    n_fp8 = 2 * 3 * DIM * HIDDEN  # six float8 weights (w1, w3, w2 of both layers)
    # Every unit is all-gathered in forward and again in backward (reshard after forward),
    # except the root (not resharded after forward): 2 layers x 2 + 1 all-gathers.
    fp32_calls, fp32_bytes = _step_bytes(None, precompute=False)
    assert fp32_calls["_allgather_base_"] == 5
    layer = (3 * DIM * HIDDEN + 2 * DIM) * 4
    head = (OUT * DIM + OUT) * 4
    assert fp32_bytes["_allgather_base_"] == 2 * 2 * layer + head
    assert fp32_bytes["_allgather_base_"] == (2 * (n_fp8 + 2 * 2 * DIM) + OUT * DIM + OUT) * 4
    # float8: 1 byte per element of the float8 weights, the rest unchanged
    f8_calls, f8_bytes = _step_bytes("tensorwise", precompute=True)
    assert f8_calls["_allgather_base_"] == 5
    f8_layer = 3 * DIM * HIDDEN * 1 + 2 * DIM * 4
    assert f8_bytes["_allgather_base_"] == 2 * 2 * f8_layer + head
    fp8_part = f8_bytes["_allgather_base_"] - 2 * 2 * 2 * DIM * 4 - head
    fp32_part = fp32_bytes["_allgather_base_"] - 2 * 2 * 2 * DIM * 4 - head
    assert fp8_part * 4 == fp32_part  # a quarter of the fp32 bytes for the float8 weights
    # the scales: one all-reduce of 6 fp32 amaxes per step (precompute); the gradients'
    # reduce-scatters are unchanged (fp32)
    assert (f8_calls["all_reduce"], f8_bytes["all_reduce"]) == (1, 6 * 4), (f8_calls, f8_bytes)
    assert fp32_calls["all_reduce"] == 0
    assert f8_bytes["_reduce_scatter_base_"] == fp32_bytes["_reduce_scatter_base_"]
    # without precomputed scales, every float8 all-gather first all-reduces its own amax
    # (one fp32 per weight: 6 weights x forward and backward)
    dyn_calls, dyn_bytes = _step_bytes("tensorwise", precompute=False)
    assert dyn_bytes["_allgather_base_"] == f8_bytes["_allgather_base_"]
    assert (dyn_calls["all_reduce"], dyn_bytes["all_reduce"]) == (12, 12 * 4), dyn_calls
    assert math.isclose(fp8_part / fp32_part, 0.25)
