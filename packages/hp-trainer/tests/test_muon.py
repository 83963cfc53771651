"""Distributed Muon against single-process torch.optim.Muon + AdamW on the same groups."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from hp_dtensor.testing import distributed
from hp_trainer import Muon, get_hyper_optimizer

DIM, HIDDEN, VOCAB = 40, 56, 50  # 56 and 50 rows: uneven shards at 3 ranks
LR, WD, ADAMW_LR = 0.02, 0.1, 3e-3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([_Block(), _Block()])
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


def _run_parity(model: nn.Module, reference: _LM) -> None:
    optim = get_hyper_optimizer(model, lr=LR, weight_decay=WD, adamw_lr=ADAMW_LR)
    ref_optims = _reference_optimizers(reference)
    assert len(optim.param_groups[0]["params"]) == 4  # up/down of 2 blocks
    gen = torch.Generator().manual_seed(1234)
    named = dict(model.named_parameters())
    for _ in range(3):
        for name, ref_p in reference.named_parameters():
            # one global gradient (as after the data-parallel reduction), laid out per rank
            full = torch.randn(ref_p.shape, generator=gen)
            ref_p.grad = full.clone()
            named[name].grad = _like(full, named[name])
        for opt in ref_optims:
            opt.step()
        optim.step()
    for name, ref_p in reference.named_parameters():
        p = named[name]
        got = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(got.detach(), ref_p.detach(), rtol=0, atol=1e-6, msg=name)
        # the momentum / Adam moments stay sharded like the parameter
        state = optim.state[p]
        buf = state.get("momentum_buffer", state.get("exp_avg"))
        if isinstance(p, DTensor):
            assert isinstance(buf, DTensor)
            assert buf.to_local().shape == p.to_local().shape


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_fsdp_matches_single_process(world_size: int) -> None:
    from hp_dtensor.testing import run_distributed

    run_distributed(_fsdp_parity, world_size)


def _fsdp_parity() -> None:
    import hp_fsdp

    torch.manual_seed(0)
    reference = _LM()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        hp_fsdp.fully_shard(layer, mesh=mesh)
    hp_fsdp.fully_shard(model, mesh=mesh)
    assert isinstance(model.layers[0].up.weight, DTensor)
    _run_parity(model, reference)


@distributed(world_size=4)
def test_muon_fsdp_tp_matches_single_process() -> None:
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
    _run_parity(model, reference)


def test_muon_single_process_equals_torch_and_rejects_non_2d() -> None:
    torch.manual_seed(0)
    reference = _LM()
    _run_parity(copy.deepcopy(reference), reference)
    with pytest.raises(ValueError, match=r"shape \(40,\) is not 2-D"):
        Muon(reference.layers[0].norm.parameters())
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon(reference.output.parameters(), adjust_lr_fn="bogus")


def test_trainer_option_builds_muon_for_the_decoder() -> None:
    from hp_trainer import Decoder, DecoderArgs, build_optimizers, parse_args

    cfg = parse_args(["--optimizer.name", "Muon", "--optimizer.lr", "0.01"])
    torch.manual_seed(0)
    model = Decoder(DecoderArgs(dim=16, n_layers=2, n_heads=2, vocab_size=64, multiple_of=16))
    (optim,) = list(build_optimizers([model], cfg.optimizer))
    assert isinstance(optim, Muon)
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
