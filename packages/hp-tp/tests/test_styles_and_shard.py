"""Styles beyond the transformer plan, ``shard_module``/``DFunction``, signatures and errors.

Distributed cases compare outputs and gradients with a single-process run of the same module.
Error and signature checks run in this process (errors on the fake backend, shape-only).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as torch_tp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import hp_tp
from hp_dtensor import init_parameters
from hp_dtensor.layout import Layout
from hp_dtensor.testing import distributed, fake_world, rank_seed

D, H, S, B = 12, 24, 6, 2


# ------------------------------------------------------------------------------------------
# a custom module, a style extended to it, and a model using NoParallel and Prepare* styles
# ------------------------------------------------------------------------------------------


class ScaledLinear(nn.Module):
    """A linear layer with a learned per-output scale: a module type no style knows."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.scale = nn.Parameter(torch.rand(d_out) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) * self.scale


class ScaledColwise(hp_tp.ColwiseParallel):
    """ColwiseParallel extended to ScaledLinear: both parameters split on the output features."""

    def param_placements(self, module: nn.Module) -> dict[str, Any]:
        if isinstance(module, ScaledLinear):
            return {"weight": Shard(0), "scale": Shard(0)}
        return super().param_placements(module)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.gate = nn.Linear(D, D)
        self.up = ScaledLinear(D, H)
        self.down = nn.Linear(H, D)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = h * torch.sigmoid(self.gate(h))
        return x + self.down(F.gelu(self.up(h))) * scale


def routed_plan() -> dict[str, Any]:
    return {
        "": hp_tp.PrepareModuleInputOutput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(1),),
            input_kwarg_layouts={"scale": Replicate()},
            desired_input_kwarg_layouts={"scale": Replicate()},
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(Replicate(),),
        ),
        "norm": hp_tp.SequenceParallel(use_local_output=True),
        # the gate stays replicated: it sees the whole sequence, its gradient is the full one
        "gate": hp_tp.NoParallel(input_layout=Shard(1), output_layout=Shard(1)),
        "up": ScaledColwise(input_layouts=Shard(1)),
        "down": hp_tp.RowwiseParallel(output_layouts=Shard(1)),
    }


def grads_full(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    return out


def run_routed() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = Routed()
    model = hp_tp.parallelize_module(copy.deepcopy(ref), mesh, routed_plan())
    assert model.gate.weight.placements == (Replicate(),)
    assert model.up.scale.placements == (Shard(0),)
    torch.manual_seed(1)  # TP ranks share the batch
    x, scale = torch.randn(B, S, D), torch.rand(D)
    outs, x_grads = [], []
    for m in (ref, model):
        xi = x.clone().requires_grad_()
        out = m(xi, scale=scale)
        assert type(out) is torch.Tensor
        assert out.shape == (B, S, D)
        out.pow(2).sum().backward()
        outs.append(out)
        x_grads.append(xi.grad)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_grads[1], x_grads[0], rtol=1e-5, atol=1e-5)
    g_ref, g = grads_full(ref), grads_full(model)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-5, msg=name)

    # column-wise embedding (the embedding dim split), gathered by a PrepareModuleOutput wrapper
    torch.manual_seed(3)
    emb_ref = nn.Sequential(nn.Embedding(10, D))
    emb = hp_tp.parallelize_module(
        copy.deepcopy(emb_ref),
        mesh,
        {
            "0": hp_tp.ColwiseParallel(use_local_output=False),
            "": hp_tp.PrepareModuleOutput(
                output_layouts=Shard(-1), desired_output_layouts=Replicate()
            ),
        },
    )
    assert emb[0].weight.placements == (Shard(1),)
    ids = torch.randint(0, 10, (B, S))
    out, out_ref = emb(ids), emb_ref(ids)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    (out * out_ref.detach()).sum().backward()
    (out_ref * out_ref.detach()).sum().backward()
    torch.testing.assert_close(
        grads_full(emb)["0.weight"], grads_full(emb_ref)["0.weight"], rtol=1e-5, atol=1e-5
    )


# ------------------------------------------------------------------------------------------
# shard_module and DFunction
# ------------------------------------------------------------------------------------------


class LocalMatmul(hp_tp.DFunction):
    """x @ w on row shards of x; w replicated, so its local gradient is a partial sum."""

    input_layouts = (Shard(0), Replicate())
    output_layouts = (Shard(0),)
    input_grad_layouts = (Shard(0), Partial())

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        assert not isinstance(x, DTensor)
        assert not isinstance(w, DTensor)
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert not isinstance(gy, DTensor)
        x, w = ctx.saved_tensors
        return gy @ w.t(), x.t() @ gy


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.proj = nn.Linear(D, H)
        self.head = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # sharded run: the local matmul with declared layouts; single process: plain matmul
        y = LocalMatmul.apply(x, self.w) if isinstance(x, DTensor) else x @ self.w
        return self.head(torch.relu(self.proj(y)))


def run_shard_module() -> None:
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    tp = Layout((ws,), ("tp",))
    torch.manual_seed(0)
    ref = Mixer()
    model = copy.deepcopy(ref)
    plan = hp_tp.ShardingPlan(
        plan={"w": Replicate(), "proj.*": Shard(0), "proj.weight": tp("None", "tp")},
        input_plan={"input": (Shard(0),), "head.input": (Replicate(),)},
        output_plan={"output": Replicate()},
        return_local_tensor=[""],
    )
    hp_tp.shard_module(model, mesh, plan)
    assert model.proj.weight.placements == (Shard(1),)  # the exact FQN wins over "proj.*"
    assert model.proj.bias.placements == (Shard(0),)
    assert model.head.weight.placements == (Replicate(),)  # not in the plan: replicated
    torch.manual_seed(2)
    x = torch.randn(B * ws, D)  # the global batch; each rank feeds its own rows
    rows = x.chunk(ws)[dist.get_rank()]
    out = model(rows)
    assert type(out) is torch.Tensor  # return_local_tensor
    expected = ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    g_ref, g = grads_full(ref), grads_full(model)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-5, msg=name)


def run_dfunction_direct() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(rank_seed(0))  # different rows on every rank
    x_local = torch.randn(3, D, requires_grad=True)
    torch.manual_seed(0)
    w = torch.randn(D, D)
    w_dt = DTensor.from_local(w, mesh, [Replicate()]).requires_grad_()
    y = LocalMatmul.apply(x_local, w_dt)  # a local argument is taken as its declared shard
    assert isinstance(y, DTensor)
    assert y.placements == (Shard(0),)
    y.sum().backward()
    assert w_dt.grad is not None
    assert x_local.grad is not None
    rows = [torch.empty_like(x_local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, x_local.detach())
    full_x = torch.cat(rows)
    torch.testing.assert_close(w_dt.grad.full_tensor(), full_x.t() @ torch.ones(len(full_x), D))
    torch.testing.assert_close(x_local.grad, torch.ones(3, D) @ w.t())
    with pytest.raises(ValueError, match="declares 2"):
        LocalMatmul.apply(x_local)


def run_meta_init() -> None:
    """Build on meta, parallelize, then materialize only the local shards (TorchTitan's flow)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build() -> nn.Module:
        return nn.Sequential(nn.Embedding(D, D), nn.Linear(D, H), nn.LayerNorm(H), nn.Linear(H, D))

    with torch.device("meta"):
        model = build()
    plan = {
        "0": hp_tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "1": hp_tp.ColwiseParallel(input_layouts=Shard(1)),
        "2": hp_tp.NoParallel(input_layout=Shard(-1), output_layout=Shard(-1)),
        "3": hp_tp.RowwiseParallel(),
    }
    hp_tp.parallelize_module(model, mesh, plan)
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    init_parameters(model)
    torch.manual_seed(0)
    ref = build()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert isinstance(p, DTensor)
        assert not p.is_meta
        assert torch.equal(p.full_tensor(), q.detach()), name


@distributed(world_size=3)
def test_meta_parallelize_then_init_parameters() -> None:
    run_meta_init()


@distributed(world_size=2)
def test_noparallel_prepare_styles_and_custom_module_two_ranks() -> None:
    run_routed()


@distributed(world_size=3)
def test_noparallel_prepare_styles_and_custom_module_three_ranks() -> None:
    run_routed()


@distributed(world_size=2)
def test_shard_module_with_dfunction_two_ranks() -> None:
    run_shard_module()


@distributed(world_size=3)
def test_shard_module_with_dfunction_three_ranks() -> None:
    run_shard_module()


@distributed(world_size=3)
def test_dfunction_local_arguments_and_partial_gradient() -> None:
    run_dfunction_direct()


# ------------------------------------------------------------------------------------------
# in-process checks: signatures and errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", torch_tp.__all__)
def test_signature_matches_torch(name: str) -> None:
    ours, theirs = (
        inspect.signature(getattr(hp_tp, name)),
        inspect.signature(getattr(torch_tp, name)),
    )
    theirs_params = [(p.name, p.kind, p.default) for p in theirs.parameters.values()]
    ours_params = [(p.name, p.kind, p.default) for p in ours.parameters.values()]
    assert ours_params[: len(theirs_params)] == theirs_params
    # extensions: keyword-only, with a default (parallelize_module's strict)
    extra = ours_params[len(theirs_params) :]
    assert all(k is inspect.Parameter.KEYWORD_ONLY and d is not inspect._empty for _, k, d in extra)
    assert [n for n, _, _ in extra] == (["strict"] if name == "parallelize_module" else [])


def test_hp_tp_does_not_use_torch_styles() -> None:
    for name in torch_tp.__all__:
        obj = getattr(hp_tp, name)
        assert obj is not getattr(torch_tp, name)
        if isinstance(obj, type):
            assert not issubclass(obj, torch_tp.ParallelStyle), name


class ForgetfulColwise(hp_tp.ColwiseParallel):
    """Places the weight but forgets the bias: an error, not a half-sharded module."""

    def param_placements(self, module: nn.Module) -> dict[str, Any]:
        return {"weight": Shard(0)}


def test_errors() -> None:
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        model = nn.Sequential(nn.Linear(8, 8), nn.Conv1d(8, 8, 1))
        with pytest.raises(ValueError, match="'2': no submodule matches '2'") as info:
            hp_tp.parallelize_module(
                model, mesh, {"0": hp_tp.ColwiseParallel(), "2": hp_tp.NoParallel()}, strict=True
            )
        assert "children of <root>: ['0', '1']" in str(info.value)
        assert not isinstance(model[0].weight, DTensor)  # a bad plan changes nothing
        with pytest.raises(TypeError, match=r"supports nn\.Linear and nn\.Embedding, got Conv1d"):
            hp_tp.parallelize_module(model, mesh, {"1": hp_tp.ColwiseParallel()})
        with pytest.raises(TypeError, match="got Conv1d"):
            hp_tp.parallelize_module(model[1], mesh, hp_tp.RowwiseParallel())
        lin = nn.Linear(8, 8)
        with pytest.raises(ValueError, match=r"and none for \['bias'\]"):
            hp_tp.parallelize_module(lin, mesh, ForgetfulColwise())
        assert not isinstance(lin.weight, DTensor)
        with pytest.raises(TypeError, match="parallelize_plan must be"):
            hp_tp.parallelize_module(model, mesh, {"0": object()})
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="needs a 1-D device mesh, got a 2-D mesh"):
            hp_tp.parallelize_module(model, mesh2d, {"0": hp_tp.ColwiseParallel()})
        with pytest.raises(ValueError, match="needs a device_mesh"):
            hp_tp.parallelize_module(model, None, {"0": hp_tp.ColwiseParallel()})
        with pytest.warns(UserWarning, match="no parallelize_plan"):
            hp_tp.parallelize_module(model, mesh)
        # wildcards and nested plans resolve; applying a style twice is an error
        deep = nn.ModuleDict(
            {"a": nn.Sequential(nn.Linear(8, 8)), "b": nn.Sequential(nn.Linear(8, 8))}
        )
        hp_tp.parallelize_module(deep, mesh, {"*": {"0": hp_tp.ColwiseParallel()}})
        assert deep["a"][0].weight.placements == deep["b"][0].weight.placements == (Shard(0),)
        with pytest.raises(ValueError, match="already a DTensor"):
            hp_tp.parallelize_module(deep, mesh, {"a.0": hp_tp.RowwiseParallel()})
        with pytest.raises(ValueError, match="they must match"):
            hp_tp.PrepareModuleInput(
                input_layouts=(Shard(0), None), desired_input_layouts=Replicate()
            )
        # shard_module
        m = nn.Sequential(nn.Linear(8, 8))
        with pytest.raises(ValueError, match="matches no parameter"):
            hp_tp.shard_module(m, mesh, hp_tp.ShardingPlan(plan={"0.wieght": Shard(0)}))
        with pytest.raises(ValueError, match="is not a submodule"):
            hp_tp.shard_module(m, mesh, hp_tp.ShardingPlan(input_plan={"1.input": Shard(0)}))
        with pytest.raises(ValueError, match="2 placements"):
            hp_tp.shard_module(m, mesh, hp_tp.ShardingPlan(plan={"0.weight": (Shard(0), Shard(1))}))
        layout = Layout((2, 2), ("dp", "tp"))
        with pytest.raises(ValueError, match="device matrix"):
            hp_tp.shard_module(m, mesh, hp_tp.ShardingPlan(plan={"0.weight": layout("tp", "None")}))
        tp = Layout((4,), ("tp",))
        with pytest.raises(ValueError, match="describes a 2-D tensor"):
            hp_tp.shard_module(m, mesh, hp_tp.ShardingPlan(plan={"0.bias": tp("tp", "None")}))
        assert not isinstance(m[0].weight, DTensor)


def test_layout_already_matching_skips_redistribute(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Shard(-1)`` is the layout DTensor stores as ``Shard(ndim - 1)``: no redistribute call."""
    from hp_tp._layout import has_layout

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        x = DTensor.from_local(torch.ones(3, 4, 5), mesh, [Shard(2)], run_check=False)
        assert has_layout(x, (Shard(-1),))
        assert has_layout(x, (Shard(2),))
        assert not has_layout(x, (Shard(1),))
        assert not has_layout(x, (Replicate(),))
        calls: list[Any] = []
        original = DTensor.redistribute

        def counted(self: DTensor, *args: Any, **kwargs: Any) -> DTensor:
            calls.append(args or kwargs)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(DTensor, "redistribute", counted)
        lin = nn.Linear(4, 6)
        hp_tp.parallelize_module(lin, mesh, hp_tp.ColwiseParallel(use_local_output=False))
        out = lin(torch.ones(3, 4))  # Replicate in, Shard(-1) out: nothing to move
        assert isinstance(out, DTensor)
        assert tuple(out.placements) == (Shard(1),)
        assert out.to_local().shape == (3, 3)
        assert calls == []
