"""Distributed Muon against single-process torch.optim.Muon + AdamW on the same groups.

Every layout (FSDP at 2 and 3 ranks with uneven shards, FSDP x TP, HSDP, expert parallel with
and without FSDP) is compared with one process running PyTorch's optimizers on the same global
gradients (different on every step, and laid out per rank as after the data-parallel
reduction). Besides the numbers, the work division is observed: Newton-Schulz calls are counted
on every rank (each matrix once in total) and collectives are counted per step (two, whatever
the number of parameters).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import hp_trainer.components.optimizer.muon as muon_module
from hp_dtensor.testing import count_host_syncs, distributed, run_distributed
from hp_trainer import Muon, get_hyper_optimizer

DIM, HIDDEN, VOCAB = 40, 56, 50  # 56 and 50 rows: uneven shards at 3 ranks
LR, WD, ADAMW_LR = 0.02, 0.1, 3e-3
STEPS = 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _LM(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([_Block() for _ in range(n_layers)])
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(h)


def _reference_optimizers(model: _LM) -> list[torch.optim.Optimizer]:
    hidden = [p for layer in model.layers for p in layer.parameters() if p.ndim == 2]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in hidden_ids]
    return [
        torch.optim.Muon(hidden, lr=LR, weight_decay=WD),
        torch.optim.AdamW(rest, lr=ADAMW_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD),
    ]


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return full.clone()
    mesh = param.device_mesh
    rep = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return rep.redistribute(mesh, param.placements)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


@contextmanager
def _observed() -> Iterator[dict[str, Any]]:
    """Count Newton-Schulz calls and the collective entry points (and every c10d op)."""
    seen: dict[str, Any] = {"ns": [], "all_to_all": 0, "events": []}
    ns, a2a, adamw = muon_module._orthogonalize, dist.all_to_all_single, muon_module.adamw
    events = seen["events"]

    class Waited:
        def __init__(self, work: Any) -> None:
            self.work = work

        def wait(self) -> Any:
            events.append("wait")
            return self.work.wait()

    def counting_ns(matrix: torch.Tensor, *args: Any) -> torch.Tensor:
        seen["ns"].append(tuple(matrix.shape))
        return ns(matrix, *args)

    def counting_a2a(*args: Any, **kwargs: Any) -> Any:
        seen["all_to_all"] += 1
        events.append("issue")
        work = a2a(*args, **kwargs)
        return Waited(work) if kwargs.get("async_op") else work

    def recorded_adamw(*args: Any, **kwargs: Any) -> None:
        events.append("adamw")
        adamw(*args, **kwargs)

    muon_module._orthogonalize = counting_ns  # type: ignore[assignment]
    muon_module.adamw = recorded_adamw
    dist.all_to_all_single = counting_a2a
    try:
        with CommDebugMode() as comm:
            yield seen
        seen["comm"] = {str(op): n for op, n in comm.get_comm_counts().items()}
        seen["total"] = comm.get_total_counts()
    finally:
        muon_module._orthogonalize = ns  # type: ignore[assignment]
        muon_module.adamw = adamw
        dist.all_to_all_single = a2a


def _run_parity(
    model: nn.Module, reference: _LM, gather_dtype: torch.dtype = torch.float32, **kwargs: Any
) -> dict[str, Any]:
    """Three steps of ours against torch's; returns the counts of the last step."""
    optim = get_hyper_optimizer(
        model, lr=LR, weight_decay=WD, adamw_lr=ADAMW_LR, gather_dtype=gather_dtype, **kwargs
    )
    ref_optims = _reference_optimizers(reference)
    assert len(optim.param_groups[0]["params"]) == 2 * len(reference.layers)  # up/down
    gen = torch.Generator().manual_seed(1234)
    named = dict(model.named_parameters())
    seen: dict[str, Any] = {}
    for step in range(STEPS):
        for name, ref_p in reference.named_parameters():
            # one global gradient (as after the data-parallel reduction), laid out per rank
            full = torch.randn(ref_p.shape, generator=gen)
            ref_p.grad = full.clone()
            named[name].grad = _like(full, named[name])
        for opt in ref_optims:
            opt.step()
        if step == STEPS - 1:
            # AdamW's step counters live on the host on every device (torch reads them there)
            counters = [st["step"] for st in optim.state.values() if "step" in st]
            with _observed() as seen, count_host_syncs(host_tensors=counters) as syncs:
                optim.step()
            seen["syncs"] = dict(syncs.by_op)
        else:
            optim.step()
    for name, ref_p in reference.named_parameters():
        p = named[name]
        torch.testing.assert_close(_full(p), ref_p.detach(), rtol=0, atol=1e-6, msg=name)
        # the momentum / Adam moments stay sharded like the parameter
        state = optim.state[p]
        buf = state.get("momentum_buffer", state.get("exp_avg"))
        if isinstance(p, DTensor):
            assert isinstance(buf, DTensor)
            assert buf.to_local().shape == p.to_local().shape
    seen["division"] = optim.work_division()
    seen["params"] = {name: _full(p) for name, p in named.items()}
    return seen


def _fsdp_lm(n_layers: int) -> tuple[nn.Module, _LM]:
    import hp_fsdp

    torch.manual_seed(0)
    reference = _LM(n_layers)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        hp_fsdp.fully_shard(layer, mesh=mesh)
    hp_fsdp.fully_shard(model, mesh=mesh)
    assert isinstance(model.layers[0].up.weight, DTensor)
    return model, reference


def _fsdp_parity() -> dict[str, Any]:
    fp32 = _run_parity(*_fsdp_lm(2), torch.float32)
    bf16 = _run_parity(*_fsdp_lm(2), torch.bfloat16)
    # the iteration rounds its input to bf16 first: a bf16 gather changes nothing, at half the bytes
    for name, value in fp32["params"].items():
        assert torch.equal(value, bf16["params"][name]), name
    assert bf16["division"]["gather_bytes"] * 2 == fp32["division"]["gather_bytes"]
    deeper_model, deeper_reference = _fsdp_lm(5)
    deeper = _run_parity(deeper_model, deeper_reference)
    # one matrix per bucket: 4 pipelined all-to-all pairs, the same numbers, the same balance
    bucketed = _run_parity(*_fsdp_lm(2), bucket_size=HIDDEN * DIM)
    for name, value in fp32["params"].items():
        assert torch.equal(value, bucketed["params"][name]), name
    assert bucketed["comm"] == {"c10d.alltoall_base_": 8}, bucketed["comm"]
    assert bucketed["events"][:6] == ["issue", "adamw", "issue", "wait", "issue", "issue"]
    assert sorted(bucketed["ns"]) == sorted(fp32["ns"])  # same owners: the load carries over
    return {
        "ns": [fp32["ns"], deeper["ns"]],
        "all_to_all": [fp32["all_to_all"], deeper["all_to_all"]],
        "events": [fp32["events"], deeper["events"]],
        "syncs": [fp32["syncs"], deeper["syncs"]],
        "comm": [fp32["comm"], deeper["comm"]],
        "division": [fp32["division"], deeper["division"]],
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_fsdp_matches_single_process_and_divides_the_work(world_size: int) -> None:
    results = run_distributed(_fsdp_parity, world_size)
    for n_layers, case in ((2, 0), (5, 1)):
        matrices = 2 * n_layers
        # every matrix orthogonalised exactly once across the ranks
        shapes = Counter(s for r in results for s in r["ns"][case])
        assert shapes == {(HIDDEN, DIM): n_layers, (DIM, HIDDEN): n_layers}
        per_rank = [len(r["ns"][case]) for r in results]
        assert sum(per_rank) == matrices
        assert max(per_rank) <= -(-matrices // world_size)  # equal shapes: an even split
        # one all-to-all to the owners, one back: independent of the parameter count
        for r in results:
            assert r["all_to_all"][case] == 2
            # the gather is in flight while AdamW steps the embeddings, norms and head
            assert r["events"][case] == ["issue", "adamw", "wait", "issue", "wait"]
            assert r["syncs"][case] == {}  # the plan is built once: no host sync in a step
            assert r["comm"][case] == {"c10d.alltoall_base_": 2}, r["comm"][case]
            division = r["division"][case]
            assert division["collectives"] == 2
            assert division["matrices"] == matrices
            assert division["owned"] == len(r["ns"][case])
        flops = [r["division"][case]["ns_flops"] for r in results]
        assert sum(flops) == results[0]["division"][case]["ns_flops_total"]


def _fsdp_tp_parity() -> dict[str, Any]:
    import hp_fsdp
    from hp_tp import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    reference = _LM()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        hp_fsdp.fully_shard(layer, mesh=mesh["dp"])
    hp_fsdp.fully_shard(model, mesh=mesh["dp"])
    assert model.layers[0].up.weight.device_mesh.ndim == 2
    return _run_parity(model, reference)


def _hsdp_parity() -> dict[str, Any]:
    import hp_fsdp

    torch.manual_seed(0)
    reference = _LM()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        hp_fsdp.fully_shard(layer, mesh=mesh)
    hp_fsdp.fully_shard(model, mesh=mesh)
    assert model.layers[0].up.weight.placements == (Replicate(), Shard(0))
    return _run_parity(model, reference)


@distributed(world_size=4)
def test_muon_fsdp_tp_and_hsdp_match_single_process() -> None:
    numel = HIDDEN * DIM
    # the owner holds 1/4 (FSDP x TP) or 1/2 (HSDP) of its matrix: the rest comes to it once
    # (fp32), and every other holder gets its part back (bf16), the HSDP replica its half
    for run, held in ((_fsdp_tp_parity, 4), (_hsdp_parity, 2)):
        seen = run()
        # 4 matrices over 4 ranks (replicas of HSDP included): one each, two all-to-alls
        assert len(seen["ns"]) == 1, (run.__name__, seen["ns"])
        assert seen["comm"] == {"c10d.alltoall_base_": 2}, seen["comm"]
        division = seen["division"]
        totals = torch.tensor(
            [len(seen["ns"]), division["gather_bytes"], division["scatter_bytes"]]
        )
        dist.all_reduce(totals)
        assert totals.tolist() == [
            4,
            4 * numel * (held - 1) // held * 4,
            4 * numel * 3 // held * 2,
        ], run.__name__


# --- expert weights -------------------------------------------------------------------------

E, EXP_DIM, EXP_HIDDEN = 4, 16, 24


class _ExpertModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from hp_cp_ep import GroupedExperts

        self.fsdp_experts = GroupedExperts(EXP_DIM, EXP_HIDDEN, E)  # EP x FSDP: whole experts
        self.replicated_experts = GroupedExperts(EXP_DIM, EXP_HIDDEN, E)  # EP, replicated on dp
        self.split_experts = GroupedExperts(EXP_DIM, EXP_HIDDEN, E)  # EP, each expert split on dp
        self.dense = nn.Linear(EXP_DIM, EXP_HIDDEN, bias=False)  # FSDP on a 1-D dp mesh
        self.flat = nn.Linear(EXP_HIDDEN, EXP_DIM, bias=False)  # on a 2-D mesh of 2 ranks


def _expert_reference(
    model: _ExpertModel, nesterov: bool = True
) -> tuple[list[nn.Parameter], torch.optim.Muon]:
    """Each expert matrix as its own torch parameter."""
    matrices = []
    for _name, p in model.named_parameters():
        stack = p.detach() if p.ndim == 3 else p.detach().unsqueeze(0)
        matrices += [nn.Parameter(m.clone()) for m in stack]
    return matrices, torch.optim.Muon(matrices, lr=LR, weight_decay=WD, nesterov=nesterov)


def _expert_parity(
    model: nn.Module, matrices: list[nn.Parameter], reference: torch.optim.Muon, **kwargs: Any
) -> tuple[Muon, dict[str, Any]]:
    """Three steps of ours against torch's Muon on every expert matrix; last step's counts."""
    optim = get_hyper_optimizer(model, lr=LR, weight_decay=WD, gather_dtype=torch.float32, **kwargs)
    assert len(optim.param_groups) == 1  # experts and matrices all go to Muon
    gen = torch.Generator().manual_seed(99)
    seen: dict[str, Any] = {}
    for step in range(STEPS):
        k = 0
        for p in model.parameters():
            full = torch.randn(p.shape, generator=gen)
            p.grad = _like(full, p)
            for m in full if p.ndim == 3 else full.unsqueeze(0):
                matrices[k].grad = m.clone()
                k += 1
        reference.step()
        if step == STEPS - 1:
            with _observed() as seen:
                optim.step()
        else:
            optim.step()
    k = 0
    for name, p in model.named_parameters():
        stack = _full(p) if p.ndim == 3 else _full(p).unsqueeze(0)
        for e, m in enumerate(stack):
            torch.testing.assert_close(
                m, matrices[k].detach(), rtol=0, atol=1e-6, msg=f"{name}[{e}]"
            )
            k += 1
    return optim, seen


@distributed(world_size=4)
def test_muon_expert_weights_each_matrix_on_its_own() -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    import hp_fsdp
    from hp_cp_ep import ExpertParallel

    torch.manual_seed(0)
    model = _ExpertModel()
    matrices, reference = _expert_reference(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    parallelize_module(model.fsdp_experts, mesh["ep"], ExpertParallel())
    hp_fsdp.fully_shard(model.fsdp_experts, mesh=mesh["dp"])
    for experts, dp_placement in (
        (model.replicated_experts, Replicate()),
        (model.split_experts, Shard(1)),
    ):
        for name in ("w1", "w2", "w3"):
            sharded = distribute_tensor(
                getattr(experts, name).detach(), mesh, [dp_placement, Shard(0)]
            )
            setattr(experts, name, nn.Parameter(sharded))
    model.dense.weight = nn.Parameter(
        distribute_tensor(model.dense.weight.detach(), mesh["dp"], [Shard(0)])
    )
    mesh3 = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "fdp", "tp"))
    model.flat.weight = nn.Parameter(
        distribute_tensor(model.flat.weight.detach(), mesh3["fdp", "tp"], [Shard(0), Shard(1)])
    )
    optim, seen = _expert_parity(model, matrices, reference)
    # expert matrices are orthogonalised as (hidden, dim) / (dim, hidden) units, never stacked
    assert all(len(shape) == 2 for shape in seen["ns"])
    counts = torch.tensor([len(seen["ns"])])
    dist.all_reduce(counts)
    # 36 expert matrices once each; dense and flat once per replica group (2 groups each)
    assert int(counts) == 3 * 3 * E + 2 * 2
    # one all-to-all pair per process group: the experts (all on the default group), dense, flat
    assert seen["comm"] == {"c10d.alltoall_base_": 6}, seen["comm"]
    division = optim.work_division()
    assert division["collectives"] == 6


@distributed(world_size=3)
def test_muon_expert_weights_uneven_at_three_ranks() -> None:
    import hp_fsdp

    torch.manual_seed(0)
    model = _ExpertModel()
    matrices, reference = _expert_reference(model, nesterov=False)  # plain momentum here
    mesh = init_device_mesh("cpu", (3,))
    hp_fsdp.fully_shard(model.fsdp_experts, mesh=mesh)  # whole experts: 2, 2, 0 per rank
    # experts 2, 2, 0 per rank; columns 6, 6, 4 (w1, w3) and 8, 8, 8 (w2)
    layouts = {"replicated_experts": Shard(0), "split_experts": Shard(2)}
    for attr, placement in layouts.items():
        experts = getattr(model, attr)
        for name in ("w1", "w2", "w3"):
            sharded = distribute_tensor(getattr(experts, name).detach(), mesh, [placement])
            setattr(experts, name, nn.Parameter(sharded))
    for linear in (model.dense, model.flat):
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
    _, seen = _expert_parity(model, matrices, reference, nesterov=False)
    counts = torch.tensor([len(seen["ns"])])
    dist.all_reduce(counts)
    assert int(counts) == 3 * 3 * E + 2  # every matrix once over the three ranks
    assert seen["comm"] == {"c10d.alltoall_base_": 2}, seen["comm"]


# --- single process and arguments -------------------------------------------------------------


def test_muon_single_process_equals_torch_and_rejects_bad_arguments() -> None:
    torch.manual_seed(0)
    reference = _LM()
    seen = _run_parity(copy.deepcopy(reference), reference)
    assert len(seen["ns"]) == 4
    assert seen["total"] == 0  # no communication in one process
    assert seen["events"] == ["adamw"]
    assert seen["syncs"] == {}
    model = copy.deepcopy(reference)
    optim = get_hyper_optimizer(model, gather_dtype=torch.float32)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    clone = copy.deepcopy(optim)  # the plans are not copied (they may hold process groups)
    assert clone.gather_dtype == torch.float32
    assert clone._plans == {}
    assert set(optim.__getstate__()) == {
        "defaults",
        "state",
        "param_groups",
        "gather_dtype",
        "bucket_size",
    }
    with pytest.raises(ValueError, match=r"shape \(40,\) is not 2-D"):
        Muon(reference.layers[0].norm.parameters())
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon(reference.output.parameters(), adjust_lr_fn="bogus")
    with pytest.raises(ValueError, match=r"gather_dtype must be torch.bfloat16 or torch.float32"):
        Muon(reference.output.parameters(), gather_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"bucket_size must be None or an integer >= 1.*got 0"):
        Muon(reference.output.parameters(), bucket_size=0)
    with pytest.raises(TypeError, match=r"gather_dtype must be a torch.dtype.*str 'bf16'"):
        Muon(reference.output.parameters(), gather_dtype="bf16")  # type: ignore[arg-type]


def test_newton_schulz_does_not_touch_its_input() -> None:
    """torch's iteration divides a bf16 input in place (a bf16 momentum buffer); ours copies."""
    matrix = torch.randn(6, 9, generator=torch.Generator().manual_seed(0)).bfloat16()
    before = matrix.clone()
    out = muon_module._orthogonalize(matrix, muon_module._NS_COEFFICIENTS, 5, 1e-7)
    assert torch.equal(matrix, before)
    assert out.shape == (6, 9)
    assert out.dtype == torch.bfloat16
    assert muon_module._newton_schulz_flops(6, 9, 5) == muon_module._newton_schulz_flops(9, 6, 5)
    assert muon_module._newton_schulz_flops(6, 9, 1) == 4 * 36 * 9 + 2 * 216


def test_trainer_option_builds_muon_for_the_decoder() -> None:
    from hp_trainer import Decoder, DecoderArgs, build_optimizers, parse_args

    cfg = parse_args(["--optimizer.name", "Muon", "--optimizer.lr", "0.01"])
    assert cfg.optimizer.muon_gather_dtype == "bf16"
    torch.manual_seed(0)
    model = Decoder(DecoderArgs(dim=16, n_layers=2, n_heads=2, vocab_size=64, multiple_of=16))
    (optim,) = list(build_optimizers([model], cfg.optimizer))
    assert isinstance(optim, Muon)
    assert optim.gather_dtype == torch.bfloat16
    muon_group, adamw_group = optim.param_groups
    adamw_ids = {id(p) for p in adamw_group["params"]}
    assert id(model.tok_embeddings.weight) in adamw_ids
    assert id(model.lm_head.weight) in adamw_ids
    assert all(p.ndim == 2 for p in muon_group["params"])
    assert adamw_group["betas"] == (cfg.optimizer.beta1, cfg.optimizer.beta2)
    tokens = torch.randint(0, 64, (2, 8))
    before = model.layers["0"].attention.wq.weight.detach().clone()
    model(tokens).float().logsumexp(-1).mean().backward()
    optim.step()
    assert not torch.equal(before, model.layers["0"].attention.wq.weight)
    assert "momentum_buffer" in optim.state[model.layers["0"].attention.wq.weight]
    fp32 = parse_args(["--optimizer.name", "Muon", "--optimizer.muon_gather_dtype", "fp32"])
    (optim,) = list(build_optimizers([model], fp32.optimizer))
    assert isinstance(optim, Muon)
    assert optim.gather_dtype == torch.float32
    with pytest.raises(ValueError, match=r"optimizer.muon_gather_dtype = 'fp16'"):
        parse_args(["--optimizer.muon_gather_dtype", "fp16"])
