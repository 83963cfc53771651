"""``torch.compile`` over sharded modules: hooks run eagerly and modules carry torch's flags."""

from __future__ import annotations

import copy

import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import hp_fsdp
from hp_dtensor.testing import distributed, rank_seed
from hp_fsdp.dynamo import DYNAMO_MODULE_FLAGS, run_eagerly
from hp_fsdp.param_group import ParamGroup
from hp_fsdp.state import FSDPState


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 4))


def _flagged(model: nn.Module) -> dict[str, tuple[bool, ...]]:
    return {
        name: tuple(bool(getattr(m, flag, False)) for flag in DYNAMO_MODULE_FLAGS)
        for name, m in model.named_modules()
    }


def test_hooks_are_hidden_from_dynamo() -> None:
    """Each hook is hp_dtensor's run_eagerly wrapper: a graph break under Dynamo, the function
    itself outside it (what the wrapper does is tested in hp-dtensor's test_eager.py)."""
    eager_code = run_eagerly(lambda: None).__code__  # type: ignore[type-var]
    for hook in (
        FSDPState._pre_forward,
        FSDPState._post_forward,
        FSDPState._pre_backward,
        FSDPState._final_callback,
        ParamGroup.post_backward,
    ):
        assert hook.__code__ is eager_code, hook
        assert callable(hook.__wrapped__), hook


@distributed(world_size=2)
def test_compiled_sharded_model_matches_torch_and_sets_flags() -> None:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base = _model()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    for api, model in ((hp_fsdp, ours), (torch_fsdp, theirs)):
        api.fully_shard(model[0], mesh=mesh)
        api.fully_shard(model[2], mesh=mesh)
        api.fully_shard(model, mesh=mesh)
    assert _flagged(ours) == _flagged(theirs)
    assert any(all(flags) for flags in _flagged(ours).values())
    gen = torch.Generator().manual_seed(rank_seed(7))
    compiled_ours = torch.compile(ours, backend="eager")
    compiled_theirs = torch.compile(theirs, backend="eager")
    for _ in range(2):
        x = torch.randn(4, 16, generator=gen)
        lo = compiled_ours(x).square().mean()
        lt = compiled_theirs(x).square().mean()
        assert torch.equal(lo, lt)
        lo.backward()
        lt.backward()
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(p.grad.to_local(), q.grad.to_local())
            p.grad = None
            q.grad = None
