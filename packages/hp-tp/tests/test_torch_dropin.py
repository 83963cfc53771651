"""Drop-in behaviour that PyTorch's own TP tests check, compared with torch 2.13 on CPU/gloo.

- A plan key that matches no submodule: PyTorch warns (``UserWarning``, "could not be resolved
  ... skipping this plan entry") and applies the rest of the plan; so does hp-tp by default, and
  ``strict=True`` (keyword-only extension) makes it a ``ValueError`` that changes nothing.
- ``PrepareModuleInput`` / ``PrepareModuleOutput`` arity errors are ``AssertionError`` in PyTorch;
  hp-tp's are instances of both ``ValueError`` and ``AssertionError`` (``hp_tp.errors``).
- ``loss_parallel`` on logits that are not sharded on the class dimension: PyTorch raises
  ``ValueError`` naming ``loss_parallel()``; hp-tp too (it used to fall through to a mixed
  DTensor/Tensor ``RuntimeError`` deep inside ``cross_entropy``).

Each case runs both libraries on the same inputs and checks they agree on the exception type
(and key phrase), the warning, and the module that results.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as torch_tp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import hp_tp
from hp_dtensor.testing import distributed, fake_world
from hp_tp.errors import TPInputTypeError, TPUsageError

LIBS: tuple[ModuleType, ModuleType] = (torch_tp, hp_tp)


def _net() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank, as src_data_rank=0 would give
    return nn.ModuleDict(
        {
            "a": nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 6)),
            "b": nn.Sequential(nn.Linear(6, 6)),
        }
    )


def _apply_recording(ns: ModuleType, plan: dict[str, Any], mesh: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = _net()
        ns.parallelize_module(net, mesh, plan)
    return net, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@distributed(world_size=3)
def test_unmatched_plan_key_warns_like_torch() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {
        ns: _apply_recording(
            ns,
            {"a.0": ns.ColwiseParallel(), "c": ns.ColwiseParallel(), "a.2": ns.RowwiseParallel()},
            mesh,
        )
        for ns in LIBS
    }
    (torch_net, torch_msgs), (hp_net, hp_msgs) = results[torch_tp], results[hp_tp]
    assert len(torch_msgs) == len(hp_msgs) == 1
    for msg in (torch_msgs[0], hp_msgs[0]):
        assert "'c' could not be resolved: no submodule matching token 'c'" in msg
        assert "skipping this plan entry" in msg
    assert "strict=True" in hp_msgs[0]  # ours says how to make it an error
    # the rest of the plan was applied, as torch applies it; same layouts, same outputs
    for name, p in torch_net.named_parameters():
        q = dict(hp_net.named_parameters())[name]
        assert isinstance(p, DTensor) == isinstance(q, DTensor), name
        if isinstance(p, DTensor):
            assert p.placements == q.placements, name
            assert torch.equal(p.to_local(), q.to_local()), name
    torch.manual_seed(10 + dist.get_rank())  # different data on each rank
    x = torch.randn(4, 6)
    assert torch.equal(torch_net["a"](x), hp_net["a"](x))


@distributed(world_size=2)
def test_unmatched_wildcard_branch_warns_per_branch_like_torch() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    counts = {}
    for ns in LIBS:
        _, msgs = _apply_recording(ns, {"*.2": ns.RowwiseParallel()}, mesh)
        counts[ns] = msgs
    assert len(counts[torch_tp]) == len(counts[hp_tp]) == 1  # branch "b" has no child "2"
    assert "no submodule matching token '2'" in counts[hp_tp][0]


def test_strict_raises_and_changes_nothing() -> None:
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        net = _net()
        with pytest.raises(ValueError, match=r"'c': no submodule matches 'c'") as info:
            hp_tp.parallelize_module(
                net, mesh, {"a.0": hp_tp.ColwiseParallel(), "c": hp_tp.NoParallel()}, strict=True
            )
        assert "children of <root>: ['a', 'b']" in str(info.value)
        assert not isinstance(net["a"][0].weight, DTensor)  # refused before any change
        with pytest.raises(ValueError, match=r"'\*\.2': no submodule matches '2'.*children of b"):
            hp_tp.parallelize_module(net, mesh, {"*.2": hp_tp.RowwiseParallel()}, strict=True)
        assert not isinstance(net["a"][2].weight, DTensor)
        with pytest.raises(TypeError):
            hp_tp.parallelize_module(net, mesh, {}, True)  # type: ignore[call-arg, misc]  # keyword-only


PREPARE_INPUT_CASES: list[dict[str, Any]] = [
    {"input_layouts": Shard(0)},  # desired_input_layouts missing
    {"input_layouts": (Shard(0), None), "desired_input_layouts": Replicate()},
    {"input_layouts": Shard(0), "desired_input_layouts": (Replicate(), None)},
    {"input_kwarg_layouts": {"a": Shard(0)}, "desired_input_kwarg_layouts": {}},
    {
        "input_kwarg_layouts": {"a": Shard(0), "b": Shard(0)},
        "desired_input_kwarg_layouts": {"a": Replicate()},
    },
]


@pytest.mark.parametrize("kwargs", PREPARE_INPUT_CASES)
def test_prepare_module_input_arity_errors_are_assertion_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(AssertionError) as theirs:
        torch_tp.PrepareModuleInput(**kwargs)
    with pytest.raises(AssertionError) as ours:
        hp_tp.PrepareModuleInput(**kwargs)
    assert type(theirs.value) is AssertionError
    assert isinstance(ours.value, TPUsageError)
    assert isinstance(ours.value, ValueError)
    # the key phrase of torch's message is in ours
    assert str(theirs.value).rstrip("!") in str(ours.value)
    with pytest.raises(AssertionError):  # the combined style checks its input half alike
        hp_tp.PrepareModuleInputOutput(
            **kwargs, output_layouts=Replicate(), desired_output_layouts=Replicate()
        )


def test_prepare_module_output_arity_error_is_assertion_error() -> None:
    kwargs: dict[str, Any] = {
        "output_layouts": (Shard(0), None),
        "desired_output_layouts": Replicate(),
    }
    with pytest.raises(AssertionError) as theirs:
        torch_tp.PrepareModuleOutput(**kwargs)
    with pytest.raises(AssertionError) as ours:
        hp_tp.PrepareModuleOutput(**kwargs)
    assert isinstance(ours.value, ValueError)
    assert str(theirs.value).rstrip("!") in str(ours.value)


class TwoInputs(nn.Module):
    def forward(self, x: Any, y: Any = None) -> Any:
        return x * 2 if isinstance(x, torch.Tensor) else x


def _forward_error(ns: ModuleType, call: Callable[[nn.Module], Any], **kw: Any) -> BaseException:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mod = TwoInputs()
    ns.parallelize_module(mod, mesh, ns.PrepareModuleInput(**kw))
    with pytest.raises(Exception) as info:  # noqa: PT011  # the type is what is compared
        call(mod)
    return info.value


@distributed(world_size=2)
def test_prepare_module_input_forward_errors_match_torch() -> None:
    one = {"input_layouts": (Shard(0),), "desired_input_layouts": (Replicate(),)}
    # a non-tensor where a layout is declared: AssertionError in torch, TypeError too in ours
    theirs = _forward_error(torch_tp, lambda m: m(3), **one)
    ours = _forward_error(hp_tp, lambda m: m(3), **one)
    assert type(theirs) is AssertionError
    assert isinstance(ours, TPInputTypeError)
    assert isinstance(ours, TypeError)
    assert "expecting input to be a torch.Tensor" in str(ours)
    # a wrong number of positional inputs: ValueError in both
    two = {"input_layouts": (Shard(0), None), "desired_input_layouts": (Replicate(), None)}
    x = torch.randn(2, 3) + dist.get_rank()
    theirs = _forward_error(torch_tp, lambda m: m(x), **two)
    ours = _forward_error(hp_tp, lambda m: m(x), **two)
    assert type(theirs) is ValueError
    assert type(ours) is ValueError


LOSS_CALLS: dict[str, Callable[[Any, Any], Any]] = {
    "cross_entropy": lambda x, t: F.cross_entropy(x, t),
    "cross_entropy_module": lambda x, t: nn.CrossEntropyLoss()(x, t),
    "nll_loss": lambda x, t: F.nll_loss(x, t),
    "log_softmax": lambda x, t: F.log_softmax(x, dim=1),
    "log_softmax_implicit_dim": lambda x, t: F.log_softmax(x),
}


@distributed(world_size=3)
def test_loss_parallel_refuses_logits_not_sharded_on_classes_like_torch() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    logits, target = torch.randn(6, 10), torch.randint(10, (6,))
    checked = 0
    for placements in ([Replicate()], [Shard(0)]):
        x = distribute_tensor(logits, mesh, placements)
        for target_kind in ("plain", "dtensor"):
            t = target if target_kind == "plain" else distribute_tensor(target, mesh, [Replicate()])
            for name, call in LOSS_CALLS.items():
                errors = {}
                for ns in LIBS:
                    with (
                        pytest.raises(ValueError, match="loss_parallel") as info,
                        ns.loss_parallel(),
                    ):
                        call(x, t)
                    errors[ns] = info.value
                key = "loss_parallel() requires exactly one mesh dim to shard tensor dimension 1"
                assert str(errors[torch_tp]).startswith(key), (placements, name)
                assert key in str(errors[hp_tp]), (placements, name, str(errors[hp_tp]))
                assert type(errors[hp_tp]) is ValueError
                checked += 1
    assert checked == 2 * 2 * len(LOSS_CALLS)
    # class-sharded logits still work in both, with the same loss (bitwise)
    x = distribute_tensor(logits, mesh, [Shard(1)])
    losses = []
    for ns in LIBS:
        with ns.loss_parallel():
            loss = F.cross_entropy(x, target)
            assert isinstance(loss, DTensor)
            losses.append(loss.full_tensor())
    assert torch.equal(losses[0], losses[1])
    # plain tensors are not loss_parallel's business in either library
    with hp_tp.loss_parallel():
        assert torch.equal(F.cross_entropy(logits, target), F.cross_entropy(logits, target))
