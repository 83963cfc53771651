"""The FSDPModule control surface and HyperParallel's extensions, observed on CPU gloo.

Each check compares against an oracle: torch's ``fully_shard`` with the same setting (bitwise),
a default hp-fsdp run (exact scaling relations), or a single process. Checks are folded into few
test functions per world size to keep the worker-pool time low.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as torch_collectives
from torch.distributed.tensor import DTensor, Replicate, Shard

import hp_fsdp
import hp_fsdp.param_group
from hp_dtensor.testing import distributed, load_test_module, rank_seed
from hp_kernels import DefaultAllGather, DefaultReduceScatter


def _helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_fsdp_helpers.py"), "hp_fsdp_tests_helpers")


def _local(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.to_local() if isinstance(t, DTensor) else t


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def _parity(world: int, setup: Callable[[Any], None], steps: int = 2, **cfg: Any) -> None:
    """Ours and torch's with the same setter calls, trained side by side: bitwise equal."""
    h = _helpers()
    config = h.Config(mesh_shape=cfg.pop("mesh_shape", (world,)), steps=steps, **cfg)
    ours, theirs, _, _ = h.build_pair(config)
    setup(ours)
    setup(theirs)
    h.compare_training(ours, theirs, config, dist.get_rank())


def _one_backward(setup: Callable[[Any], None] | None, world: int, keep_model: bool = False) -> Any:
    """Gradients of one backward of an hp-fsdp model (same seed, rank-dependent data)."""
    h = _helpers()
    mesh = h.build_mesh((world,))
    torch.manual_seed(0)
    model = h.TinyLM(blocks=1)
    h.apply_sharding(model, hp_fsdp, h.Config(mesh_shape=(world,)), mesh)
    if keep_model:
        return model
    if setup is not None:
        setup(model)
    h.loss_fn(model, h.make_batch(h.data_seed(0, 0, dist.get_rank()))).backward()
    return _grads(model)


class _CountingAllGather(DefaultAllGather):
    def __init__(self) -> None:
        self.calls = 0
        self.allocations = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().__call__(*args, **kwargs)


class _CountingReduceScatter(DefaultReduceScatter):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().__call__(*args, **kwargs)


class _TorchCountingAllGather(torch_collectives.DefaultAllGather):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().__call__(*args, **kwargs)


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _Branchy(nn.Module):
    """One unit whose ranks take different branches (unused parameters differ per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        return self.a(x) if use_a else self.b(x)


class _Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.proj.weight.t()).sum(-1)


def _check_reduction_settings(world: int) -> None:
    base = _one_backward(None, world)
    summed = _one_backward(_each(lambda u: u.set_reduce_op_type("sum")), world)
    for name, grad in base.items():
        torch.testing.assert_close(summed[name], grad * world, rtol=1e-5, atol=1e-6)
    halved = _one_backward(_each(lambda u: u.set_gradient_scaling_factor(0.5)), world)
    tensor_scaled = _one_backward(
        _each(lambda u: u.set_gradient_scaling_factor(torch.tensor(0.5))), world
    )
    doubled = _one_backward(_each(lambda u: u.set_all_reduce_hook(lambda t: t.mul_(2))), world)
    for name, grad in base.items():
        assert torch.equal(halved[name], grad * 0.5), name
        assert torch.equal(tensor_scaled[name], grad * 0.5), name
        assert torch.equal(doubled[name], grad * 2), name
    restored = _one_backward(
        _each(lambda u: (u.set_gradient_scaling_factor(3.0), u.set_gradient_scaling_factor(None))),
        world,
    )
    for name, grad in base.items():
        assert torch.equal(restored[name], grad), name


def _group(module: nn.Module) -> Any:
    state = hp_fsdp.get_hsdp_state(module)
    assert state is not None
    assert len(state.groups) == 1
    return state.groups[0]


def _units(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, (hp_fsdp.FSDPModule, TorchFSDPModule))]


def _each(fn: Callable[[Any], Any]) -> Callable[[nn.Module], None]:
    def apply(model: nn.Module) -> None:
        for unit in _units(model):
            fn(unit)

    return apply


def _alias_setup(model: nn.Module) -> None:
    for unit in _units(model):
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_reduce_scatter_divide_factor(3.0)


def _divide_factor_setup(model: nn.Module) -> None:
    for unit in _units(model):  # per unit, as in torch
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(2.0 * dist.get_world_size())


def _main_grad_run(
    dtype: torch.dtype, flag: bool, seeds: list[int]
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(dtype)
    policy = hp_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, apply_grad_on_fp32_main_grad=flag
    )
    hp_fsdp.fully_shard(model[0], mesh=mesh, mp_policy=policy)
    hp_fsdp.fully_shard(model, mesh=mesh, mp_policy=policy)
    for seed in seeds:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank_seed(seed)))
        model(x.to(dtype)).float().square().mean().backward()
    mains = {n: _local(p.main_grad) for n, p in model.named_parameters() if flag}
    return model, mains


def _check_fp32_main_grad() -> None:
    # float32 parameters: main_grad is .grad, bitwise equal to the default policy's gradient.
    plain, _ = _main_grad_run(torch.float32, False, [1])
    model, mains = _main_grad_run(torch.float32, True, [1])
    expected = _grads(plain)
    for name, param in model.named_parameters():
        assert param.grad is param.main_grad, name
        assert torch.equal(mains[name], expected[name]), name
    # bfloat16 parameters: main_grad stays float32 and accumulates in float32 across backwards.
    both, mains_both = _main_grad_run(torch.bfloat16, True, [1, 2])
    _, mains_1 = _main_grad_run(torch.bfloat16, True, [1])
    _, mains_2 = _main_grad_run(torch.bfloat16, True, [2])
    for name, param in both.named_parameters():
        assert mains_both[name].dtype == torch.float32, name
        assert torch.equal(mains_both[name], mains_1[name] + mains_2[name]), name
        assert torch.equal(_local(param.grad), mains_both[name].to(torch.bfloat16)), name
    both.zero_grad()
    assert all(getattr(p, "main_grad", None) is None for p in both.parameters())


@distributed(world_size=2, timeout=120)
def test_control_surface_ws2() -> None:
    h = _helpers()
    rank = dist.get_rank()
    # set_gradient_divide_factor(f) with force-sum: bitwise equal to torch with the same.
    _parity(2, _divide_factor_setup)
    # The deprecated alias sets the same factor (bitwise with torch's alias) and warns.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _parity(2, _alias_setup)
    probe = _one_backward(None, 2, keep_model=True)
    with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
        probe.set_reduce_scatter_divide_factor(3.0)
    # sum = ws x avg; scaling factor 0.5 (float or tensor) halves; the hook runs on the shard.
    _check_reduction_settings(2)

    # Custom all-gather / reduce-scatter (ours, and torch's class): called, parity kept.
    ag, rs, torch_ag = _CountingAllGather(), _CountingReduceScatter(), _TorchCountingAllGather()
    config = h.Config(mesh_shape=(2,), steps=1)
    ours, theirs, _, _ = h.build_pair(config)
    ours.set_custom_all_gather(ag)
    ours.layers[0].set_custom_all_gather(torch_ag)
    ours.set_custom_reduce_scatter(rs)
    h.compare_training(ours, theirs, config, rank)
    assert ag.calls >= 1
    assert ag.allocations == ag.calls
    assert torch_ag.calls == 2  # forward + backward of the resharded block
    assert rs.calls == 1
    with pytest.raises(TypeError, match="AllGather"):
        ours.set_custom_all_gather(rs)

    # Capabilities and hints on the CPU.
    ours.set_all_reduce_hook(lambda t: None, stream=object())  # a hint on the CPU, as in torch
    with pytest.raises(RuntimeError, match="SM90"):
        ours.set_symm_mem_for_comm()
    handler = _ListHandler()
    logger = logging.getLogger("hp_fsdp")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        for _ in range(2):
            ours.set_post_optim_event(object())  # type: ignore[arg-type]
            ours.set_allocate_memory_from_process_group_for_comm(True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert sum("set_post_optim_event" in m for m in handler.messages) == 1, handler.messages
    assert sum("allocator" in m for m in handler.messages) == 1, handler.messages

    # Unit-level options that keep torch's numbers: parity with torch set the same way.
    def options(m: Any) -> None:
        m.set_reduce_scatter_max_input_buffers(2)
        m.set_separate_reduce_scatter_group(True)

    _parity(2, options)
    # set_reshard_after_backward / _forward with recurse=False touch this unit only.
    probe.set_reshard_after_backward(False, recurse=False)
    probe.set_reshard_after_forward(False, recurse=False)
    root_group, layer_group = _group(probe), _group(probe.layers[0])
    assert (
        root_group.options.reshard_after_backward,
        layer_group.options.reshard_after_backward,
    ) == (False, True)
    assert (root_group.reshard_after_forward, layer_group.reshard_after_forward) == (False, True)
    probe.set_reshard_after_backward(False)
    assert layer_group.options.reshard_after_backward is False
    with pytest.raises(ValueError, match="max_input_buffers"):
        ours.set_reduce_scatter_max_input_buffers(0)

    # set_unshard_in_backward(False) on the embedding/head unit skips its backward all-gather.
    _check_unshard_in_backward()
    # set_reduce_scatter_unused_params(True): ranks take different branches and complete.
    _check_unused_params()
    # reset_iter_state after an exception mid-forward: the next steps keep parity.
    _check_reset_iter_state()
    # register_fsdp_forward_method, state accessors, class cache, new-init switch.
    _check_module_level_api()
    # shard_placement_fn -> ShardPlacementResult, ignored_params.
    _check_placement_result_and_ignored_params()
    # load_state_dict with each input kind; zero_grad clears no-sync accumulation.
    _check_load_state_dict_and_zero_grad()
    # hsdp_sync_stream finishes reductions left pending by set_is_last_backward(False).
    _check_hsdp_sync_stream()
    # MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True).
    _check_fp32_main_grad()


class _EmbedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(tokens))


def _embed_mlp_grads(base: nn.Module, skip: bool) -> tuple[int, dict[str, torch.Tensor]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = copy.deepcopy(base)
    hp_fsdp.fully_shard(model.embed, mesh=mesh)
    hp_fsdp.fully_shard(model, mesh=mesh)
    if skip:  # the embedding's backward reads no parameter values
        model.embed.set_unshard_in_backward(False)
    calls: list[int] = []
    original = dist.all_gather_single

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_gather_single = spy
    try:
        tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(rank_seed(3)))
        model(tokens).square().mean().backward()
    finally:
        dist.all_gather_single = original
    return len(calls), _grads(model)


def _check_unshard_in_backward() -> None:
    torch.manual_seed(0)
    base = _EmbedMLP()
    n_default, g_default = _embed_mlp_grads(base, False)
    n_skip, g_skip = _embed_mlp_grads(base, True)
    assert n_skip == n_default - 1, (n_default, n_skip)
    assert g_skip.keys() == g_default.keys()
    for name, grad in g_default.items():
        assert torch.equal(g_skip[name], grad), name


def _check_unused_params() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = _Branchy()
    model = copy.deepcopy(base)
    hp_fsdp.fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank_seed(5))
    x = torch.randn(4, 8)
    model(x, rank % 2 == 0).sum().backward()
    # Oracle: every rank's contribution summed on one process, divided by the world size.
    inputs = [torch.empty(4, 8) for _ in range(world)]
    dist.all_gather(inputs, x)
    ref = copy.deepcopy(base)
    for r, xr in enumerate(inputs):
        (ref(xr, r % 2 == 0).sum() / world).backward()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        ref_grad = ref.get_parameter(name).grad
        assert ref_grad is not None
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad.full_tensor(), ref_grad, rtol=1e-5, atol=1e-6)


def _check_reset_iter_state() -> None:
    h = _helpers()
    config = h.Config(mesh_shape=(dist.get_world_size(),), steps=2)
    ours, theirs, _, _ = h.build_pair(config)
    rank = dist.get_rank()
    for model in (ours, theirs):
        h.loss_fn(model, h.make_batch(h.data_seed(9, 0, rank))).backward()
        model.zero_grad()
        norm = model.norm
        original = norm.forward

        def boom(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected failure")

        norm.forward = boom
        with pytest.raises(RuntimeError, match="injected"):
            h.loss_fn(model, h.make_batch(0))
        norm.forward = original
        with pytest.raises(RuntimeError, match="root"):
            model.layers[0].reset_iter_state()
        model.reset_iter_state()
    h.compare_training(ours, theirs, config, rank)


def _check_module_level_api() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = _Scorer()
    ref = copy.deepcopy(model)
    hp_fsdp.fully_shard(model, mesh=mesh, reshard_after_forward=True)
    x = torch.randn(3, 8)
    model(x)  # lazy init as root
    with pytest.raises(Exception):  # noqa: B017, PT011 - sharded weight cannot meet a plain input
        model.score(x)
    hp_fsdp.register_fsdp_forward_method(model, "score")
    out = model.score(x)
    torch.testing.assert_close(out, ref.score(x))
    assert isinstance(model.proj.weight, DTensor)  # resharded afterwards
    hp_fsdp.register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # no-op for plain modules

    state = hp_fsdp.fully_shard.state(model)
    assert state is not None
    assert state is hp_fsdp.get_hsdp_state(model)
    assert hp_fsdp.fully_shard.state(nn.Linear(2, 2)) is None
    assert hp_fsdp.is_dtensor_managed_param(model.proj.weight)
    assert not hp_fsdp.is_dtensor_managed_param(nn.Parameter(torch.ones(2)))
    fsdp_cls = hp_fsdp.get_cls_to_fsdp_cls()[_Scorer]
    assert type(model) is fsdp_cls
    assert isinstance(model, hp_fsdp.HSDPModule)
    assert issubclass(fsdp_cls, _Scorer)
    made = fsdp_cls()  # __new__ builds (and initializes) the original class
    assert type(made) is _Scorer
    assert hasattr(made, "proj")
    with hp_fsdp.disable_fsdp_module_new_init():
        bare = fsdp_cls()
    assert type(bare) is _Scorer
    assert "_modules" not in bare.__dict__


def _check_placement_result_and_ignored_params() -> None:
    """ShardPlacementResult on the unit's mesh and ignored_params: as torch, bitwise."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = _Scorer()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    info = hp_fsdp.FSDPMeshInfo(mesh, shard_mesh_dim=0)
    hp_fsdp.fully_shard(
        ours,
        mesh=mesh,
        shard_placement_fn=lambda p: (
            hp_fsdp.ShardPlacementResult(Shard(1), info) if p.ndim == 2 else None
        ),
        ignored_params={ours.proj.bias},
    )
    torch_fsdp.fully_shard(
        theirs,
        mesh=mesh,
        shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None,
        ignored_params={theirs.proj.bias},
    )
    assert isinstance(ours.proj.weight, DTensor)
    assert isinstance(theirs.proj.weight, DTensor)
    assert ours.proj.weight.placements == theirs.proj.weight.placements == (Shard(1),)
    assert not isinstance(ours.proj.bias, DTensor)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank_seed(11)))
    for model in (ours, theirs):
        model(x).square().sum().backward()
    assert torch.equal(_local(ours.proj.weight.grad), _local(theirs.proj.weight.grad))
    assert torch.equal(_local(ours.proj.bias.grad), _local(theirs.proj.bias.grad))  # unreduced
    replicate_only = hp_fsdp.DDPMeshInfo(mesh, replicate_mesh_dim=0)
    with pytest.raises(ValueError, match="needs a shard dim"):
        hp_fsdp.fully_shard(
            _Scorer(),
            mesh=mesh,
            shard_placement_fn=lambda p: hp_fsdp.ShardPlacementResult(None, replicate_only),  # type: ignore[arg-type]
        )


def _check_load_state_dict_and_zero_grad() -> None:
    h = _helpers()
    world, rank = dist.get_world_size(), dist.get_rank()
    config = h.Config(mesh_shape=(world,), steps=1)
    ours, _, ref, _ = h.build_pair(config)
    torch.manual_seed(77)
    source = h.TinyLM(blocks=config.blocks)
    full = source.state_dict()
    sharded_source = copy.deepcopy(source)
    h.apply_sharding(sharded_source, hp_fsdp, config, h.build_mesh((world,)))
    dtensors = sharded_source.state_dict()
    locals_ = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in dtensors.items()}

    def check(model: nn.Module) -> None:
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor)
            assert torch.equal(param.full_tensor(), full[name]), name

    for kind in (full, dtensors, locals_):
        fresh, _, _, _ = h.build_pair(config)
        fresh.load_state_dict(kind)
        check(fresh)
        # and the loaded model still trains like torch's loading the same global weights
    assigned, _, _, _ = h.build_pair(config)
    assigned.load_state_dict(dtensors, assign=True)
    check(assigned)
    assert assigned.embed.weight is assigned.head.weight  # tied parameters stay tied
    assert all(hp_fsdp.is_dtensor_managed_param(p) for p in assigned.parameters())  # adopted
    assert hp_fsdp.infer_fully_shard_param_mode(assigned.embed.weight) == "fsdp"
    assert hp_fsdp.infer_fully_shard_param_mode(torch.ones(2)) is None
    # The assigned parameters are adopted by the engine: training matches copy-loading.
    copied, _, _, _ = h.build_pair(config)
    copied.load_state_dict(full)
    h.compare_training(assigned, copied, h.Config(mesh_shape=(world,), steps=2), rank)
    with pytest.raises(RuntimeError, match="Unexpected"):
        ours.load_state_dict({**full, "bogus": torch.ones(1)})
    missing = ours.load_state_dict({"pos": full["pos"]}, strict=False)
    assert "embed.weight" in missing.missing_keys
    with pytest.raises(ValueError, match="shape"):
        ours.load_state_dict({**full, "pos": torch.ones(3, 3)})

    # The re-exported state-dict helpers: broadcast from rank 0 leaves the caller's dict as is.
    target, _, _, _ = h.build_pair(config)
    given = {k: v.clone() for k, v in full.items()} if rank == 0 else {}
    snapshot = {k: v.clone() for k, v in given.items()}
    options = hp_fsdp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    hp_fsdp.set_model_state_dict(target, given, options=options)
    assert given.keys() == snapshot.keys()
    assert all(torch.equal(given[k], snapshot[k]) for k in snapshot)
    check(target)
    gathered = hp_fsdp.get_model_state_dict(
        target, options=hp_fsdp.StateDictOptions(full_state_dict=True)
    )
    assert torch.equal(gathered["pos"], full["pos"])

    # zero_grad clears the unsharded accumulation of a no-sync micro-batch.
    model, _, _, _ = h.build_pair(config)
    model.set_requires_gradient_sync(False)
    h.loss_fn(model, h.make_batch(h.data_seed(1, 0, rank))).backward()
    model.zero_grad()
    model.set_requires_gradient_sync(True)
    h.loss_fn(model, h.make_batch(h.data_seed(2, 0, rank))).backward()
    fresh, _, _, _ = h.build_pair(config)
    h.loss_fn(fresh, h.make_batch(h.data_seed(2, 0, rank))).backward()
    expected = _grads(fresh)
    for name, grad in _grads(model).items():
        assert torch.equal(grad, expected[name]), name
    del ref


def _check_hsdp_sync_stream() -> None:
    h = _helpers()
    rank = dist.get_rank()
    config = h.Config(mesh_shape=(dist.get_world_size(),), steps=1)
    ours, theirs, _, _ = h.build_pair(config)
    ours.set_is_last_backward(False)
    h.loss_fn(ours, h.make_batch(rank)).backward()
    h.loss_fn(theirs, h.make_batch(rank)).backward()
    pending = hp_fsdp.get_hsdp_state(ours)
    assert pending is not None
    assert pending.ctx.pending_reductions, "expected reductions left in flight"
    hp_fsdp.hsdp_sync_stream(ours)
    assert not pending.ctx.pending_reductions
    h.assert_bitwise(ours, theirs, "after hsdp_sync_stream")
    hp_fsdp.hsdp_sync_stream()  # every root: nothing pending, returns
    with pytest.raises(TypeError, match="fully_shard"):
        hp_fsdp.hsdp_sync_stream(nn.Linear(2, 2))


def _check_replicate() -> None:
    """hp_fsdp.replicate against torch's FSDP-based replicate (bitwise) and a single process."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate

    h = _helpers()
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = h.TinyLM(blocks=1)
    ours, theirs, ref = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    for model, fn in ((ours, hp_fsdp.replicate), (theirs, torch_replicate)):
        for layer in model.layers:
            fn(layer, mesh=mesh)
        fn(model, mesh=mesh)
    assert isinstance(ours, hp_fsdp.ReplicateModule)
    assert isinstance(ours, hp_fsdp.FSDPModule)
    weight = ours.layers[0].up.weight
    assert isinstance(weight, DTensor)
    assert weight.placements == (Replicate(),)
    assert weight.to_local().shape == weight.shape
    config = h.Config(mesh_shape=(world,), steps=2)
    h.compare_training(ours, theirs, config, rank)
    # Against one process on the global batch: same update on every rank.
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(config.steps):
        losses = [h.loss_fn(ref, h.make_batch(h.data_seed(step, 0, r))) for r in range(world)]
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad()
    for name, param in ours.named_parameters():
        torch.testing.assert_close(
            param.to_local(), ref.get_parameter(name).detach(), rtol=1e-4, atol=1e-4
        )


def _build_with(world: int, **kwargs: Any) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(ours with extra fully_shard keywords, torch's, unsharded reference), same seed."""
    h = _helpers()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = h.TinyLM()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    for layer in ours.layers:
        hp_fsdp.fully_shard(layer, mesh=mesh, **kwargs)
    hp_fsdp.fully_shard(ours, mesh=mesh, **kwargs)
    h.apply_sharding(theirs, torch_fsdp, h.Config(mesh_shape=(world,)), mesh)
    return ours, theirs, base


def _check_fully_shard_extensions() -> None:
    h = _helpers()
    world, rank = dist.get_world_size(), dist.get_rank()
    config = h.Config(mesh_shape=(world,), steps=2)
    # comm_fusion_zero_copy: shards live in one flat buffer, no copy-in; bitwise with torch.
    ours, theirs, _ = _build_with(world, comm_fusion_zero_copy=True)
    calls: list[int] = []
    original = hp_fsdp.param_group.issue_all_gather

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    hp_fsdp.param_group.issue_all_gather = spy
    try:
        h.compare_training(ours, theirs, config, rank)
    finally:
        hp_fsdp.param_group.issue_all_gather = original
    assert not calls, "zero-copy units must all-gather their flat shard buffer directly"
    layer = ours.layers[0]
    ptrs = {p.to_local().untyped_storage().data_ptr() for p in layer.parameters()}
    assert len(ptrs) == 1, "a zero-copy unit's local shards share one buffer"

    # comm_fusion=False: one all-gather per parameter, same numbers up to reduction order.
    unfused, _, _ = _build_with(world, comm_fusion=False)
    fused, _, _ = _build_with(world)
    counts: list[int] = []

    def count(*args: Any, **kwargs: Any) -> Any:
        counts.append(1)
        return original(*args, **kwargs)

    hp_fsdp.param_group.issue_all_gather = count
    try:
        h.loss_fn(unfused, h.make_batch(rank)).backward()
    finally:
        hp_fsdp.param_group.issue_all_gather = original
    n_params = len(list(unfused.parameters()))
    n_block = len(list(unfused.layers[0].parameters()))
    assert len(counts) == n_params + 2 * n_block  # blocks gathered again in backward
    h.loss_fn(fused, h.make_batch(rank)).backward()
    expected = _grads(fused)
    for name, grad in _grads(unfused).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6)

    # Sharded gradient accumulation: no unsharded gradient kept between micro-batches;
    # matches a single process on the global batches (tolerance: a different summation).
    acc, _, ref = _build_with(world, sharded_accumulated_grad=True)
    opt = torch.optim.AdamW(acc.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        for micro in range(2):
            acc.set_requires_gradient_sync(micro == 1)
            h.loss_fn(acc, h.make_batch(h.data_seed(step, micro, rank))).backward()
            if micro == 0:
                group = _group(acc.layers[0])
                assert all(p.unsharded_accumulated_grad is None for p in group.params)
                assert all(p.unsharded_param.grad is None for p in group.params)
                assert acc.layers[0].up.weight.grad is not None  # already a reduced shard
            batches = [h.make_batch(h.data_seed(step, micro, r)) for r in range(world)]
            torch.stack([h.loss_fn(ref, b) for b in batches]).mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, param in acc.named_parameters():
        full = param.full_tensor()
        torch.testing.assert_close(full, ref.get_parameter(name).detach(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="replicate_params"):
        hp_fsdp.fully_shard(nn.Linear(4, 4), replicate_params={nn.Parameter(torch.ones(1))})
    _check_replicate_params()


def _check_replicate_params(mesh_shape: tuple[int, ...] | None = None) -> None:
    """replicate_params stay whole and equal on all ranks; training matches one process.

    On a 2-D (HSDP) mesh they are ``(Replicate(), Replicate())`` and all-reduced over all ranks.
    """
    h = _helpers()
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = mesh_shape or (world,)
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    sharded = (Replicate(), Shard(0)) if len(shape) == 2 else (Shard(0),)
    torch.manual_seed(0)
    ref = h.TinyLM()
    model = copy.deepcopy(ref)
    for layer in model.layers:
        hp_fsdp.fully_shard(
            layer, mesh=mesh, replicate_params={layer.norm1.weight, layer.norm1.bias}
        )
    hp_fsdp.fully_shard(model, mesh=mesh, replicate_params={model.pos, model.norm.weight})
    replicated = {"pos", "norm.weight"} | {
        f"layers.{i}.norm1.{n}" for i in range(len(model.layers)) for n in ("weight", "bias")
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        h.loss_fn(model, h.make_batch(h.data_seed(step, 0, rank))).backward()
        batches = [h.make_batch(h.data_seed(step, 0, r)) for r in range(world)]
        torch.stack([h.loss_fn(ref, b) for b in batches]).mean().backward()
        for opt_ in (opt, ref_opt):
            opt_.step()
            opt_.zero_grad()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        expected = ref.get_parameter(name).detach()
        mode = hp_fsdp.infer_fully_shard_param_mode(param)
        assert mode == ("ddp" if name in replicated else "hsdp" if len(shape) == 2 else "fsdp")
        if name in replicated:
            assert param.placements == (Replicate(),) * len(shape), name
            assert param.to_local().shape == expected.shape, name
            copies = [torch.empty_like(param.to_local()) for _ in range(world)]
            dist.all_gather(copies, param.to_local().contiguous())
            assert all(torch.equal(c, copies[0]) for c in copies), name
        else:
            assert param.placements == sharded, name
        torch.testing.assert_close(param.full_tensor(), expected, rtol=1e-4, atol=1e-4)


@distributed(world_size=3, timeout=120)
def test_control_surface_ws3() -> None:
    _parity(3, _divide_factor_setup)
    _check_reduction_settings(3)
    _check_unused_params()
    _check_replicate()
    _check_fully_shard_extensions()


def _all_reduce_counter() -> tuple[list[int], Callable[[], None]]:
    calls: list[int] = []
    original = dist.all_reduce

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = spy

    def restore() -> None:
        dist.all_reduce = original

    return calls, restore


@distributed(world_size=4, timeout=300)  # a hang guard; this test took 123 s on a loaded CI run
def test_control_surface_ws4_hsdp_and_shared_ctx() -> None:
    h = _helpers()
    rank = dist.get_rank()
    # set_requires_all_reduce(False) skips the replicate-axis reduction (HSDP 2x2).
    config = h.Config(mesh_shape=(2, 2), steps=1)
    ours, theirs, _, mesh = h.build_pair(config)
    ours.set_requires_all_reduce(False)
    theirs.set_requires_all_reduce(False)
    calls, restore = _all_reduce_counter()
    try:
        h.loss_fn(ours, h.make_batch(rank)).backward()
    finally:
        restore()
    assert not calls
    h.loss_fn(theirs, h.make_batch(rank)).backward()
    ours.set_requires_all_reduce(True)
    theirs.set_requires_all_reduce(True)
    calls, restore = _all_reduce_counter()
    try:
        h.loss_fn(ours, h.make_batch(rank + 10)).backward()
    finally:
        restore()
    assert len(calls) == 3  # one per unit: 2 blocks and the root
    h.loss_fn(theirs, h.make_batch(rank + 10)).backward()
    h.assert_bitwise(ours, theirs, "requires_all_reduce False then True")
    # HSDP with sum reduction: ws x the average.
    summed, _, _, _ = h.build_pair(config)
    _each(lambda u: u.set_reduce_op_type("sum"))(summed)
    avg, _, _, _ = h.build_pair(config)
    for model in (summed, avg):
        h.loss_fn(model, h.make_batch(rank)).backward()
    expected = {n: g * 4 for n, g in _grads(avg).items()}
    for name, grad in _grads(summed).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6)
    del mesh

    # share_comm_ctx: two roots with reshard_after_forward=2 share their post-forward groups.
    cfg2 = h.Config(mesh_shape=(4,), steps=2, reshard=2)
    a_ours, a_theirs, _, _ = h.build_pair(cfg2)
    b_ours, b_theirs, _, _ = h.build_pair(cfg2)
    hp_fsdp.share_comm_ctx([a_ours, b_ours])
    h.compare_training(a_ours, a_theirs, cfg2, rank)
    h.compare_training(b_ours, b_theirs, cfg2, rank)
    state_a, state_b = hp_fsdp.get_hsdp_state(a_ours), hp_fsdp.get_hsdp_state(b_ours)
    assert state_a is not None
    assert state_b is not None
    assert state_a.ctx.comm is state_b.ctx.comm
    groups = list(state_a.ctx.comm.post_forward_groups.values())
    assert len(groups) == 1  # created once for both roots
    layer_state = hp_fsdp.get_hsdp_state(b_ours.layers[0])
    assert layer_state is not None
    assert layer_state.groups[0].post_forward_info is groups[0]
    _check_replicate_params((2, 2))
