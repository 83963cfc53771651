"""Splitting a decoder into stages: cost balance, FQNs unchanged, loop and V placement."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hp_pp
from hp_dtensor.testing import distributed

VOCAB, DIM, SEQ = 32, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.attn(h))
        return h + torch.tanh(self.mlp(h))


class ToyDecoder(nn.Module):
    """Embedding, blocks, norm, head; skips parts set to None (TorchTitan's convention)."""

    def __init__(self, n_layers: int = 4, as_list: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        blocks = [Block() for _ in range(n_layers)]
        self.layers: nn.Module = (
            nn.ModuleList(blocks)
            if as_list
            else nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        )
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in layers:
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def test_fqns_balanced_by_cost() -> None:
    parts = hp_pp.generate_llm_fqn_per_model_part(4, 6)
    assert parts == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["layers.5", "norm", "output"],
    ]
    heavy_head = hp_pp.generate_llm_fqn_per_model_part(2, 6, output_weight=3)
    assert heavy_head[1][-2:] == ["norm", "output"]
    assert len(heavy_head[1]) < len(heavy_head[0])
    measured = hp_pp.generate_llm_fqn_per_model_part(2, 2, layer_costs=[5.0, 1.0, 1.0, 1.0])
    assert measured == [["tok_embeddings"], ["layers.0", "layers.1", "norm", "output"]]
    with pytest.raises(ValueError, match="into 5 stages"):
        hp_pp.generate_llm_fqn_per_model_part(5, 2)
    with pytest.raises(ValueError, match="layer_costs needs 4 entries"):
        hp_pp.generate_llm_fqn_per_model_part(2, 2, layer_costs=[1.0])


@pytest.mark.parametrize("as_list", [False, True])
def test_stages_union_to_the_whole_model_with_fqns_unchanged(as_list: bool) -> None:
    torch.manual_seed(0)
    model = ToyDecoder(5, as_list=as_list)
    parts = hp_pp.generate_llm_fqn_per_model_part(3, 5)
    stages = [hp_pp.split_module_by_fqns(model, fqns) for fqns in parts]
    union: dict[str, torch.Tensor] = {}
    for stage in stages:
        sd = stage.state_dict()
        assert not set(sd) & set(union), "a parameter sits in two stages"
        union.update(sd)
    full = model.state_dict()
    assert set(union) == set(full)
    assert all(torch.equal(union[k], full[k]) for k in full)
    # Loading the union back into an unpipelined model is exact (checkpoint round trip).
    fresh = ToyDecoder(5, as_list=as_list)
    fresh.load_state_dict(union)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    h: torch.Tensor = tokens
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)
    torch.testing.assert_close(fresh(tokens), model(tokens), rtol=0, atol=0)
    assert stages[1].tok_embeddings is None
    assert stages[1].output is None
    with pytest.raises(ValueError, match="names no child"):
        hp_pp.split_module_by_fqns(model, ["embeddings"])
    with pytest.raises(ValueError, match="has no entry '9'"):
        hp_pp.split_module_by_fqns(model, ["layers.9"])


def _pipeline_llm(schedule: str, override: list[list[str]] | None) -> None:
    torch.manual_seed(0)
    model = ToyDecoder(4)
    ref = ToyDecoder(4)
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (4, SEQ), generator=g)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    sched, parts, has_first, has_last = hp_pp.pipeline_llm(
        model,
        pp_mesh=dist.group.WORLD,
        schedule=schedule,
        n_microbatches=2,
        loss_fn=loss_fn,
        device=torch.device("cpu"),
        module_fqns_per_model_part=override,
    )
    losses: list[torch.Tensor] = []
    sched.step(
        *((tokens,) if has_first else ()),
        target=labels if has_last else None,
        losses=losses,
    )
    for xm, ym in zip(tokens.chunk(2), labels.chunk(2), strict=True):
        (loss_fn(ref(xm), ym) / 2).backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    names = [k for part in parts for k, _ in part.named_parameters()]
    assert names
    for part in parts:
        for k, p in part.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[k], rtol=1e-6, atol=1e-6)
    if schedule == "ZBVZeroBubble":
        # V placement: rank 0 holds the first and the last stage.
        assert has_first == has_last == (dist.get_rank() == 0)


@pytest.mark.parametrize(
    ("schedule", "override"),
    [
        ("1F1B", None),
        ("ZBVZeroBubble", None),
        (
            "Interleaved1F1B",
            [
                ["tok_embeddings"],
                ["layers.0", "layers.1"],
                ["layers.2"],
                ["layers.3", "norm", "output"],
            ],
        ),
    ],
)
@distributed(world_size=2)
def test_pipeline_llm_equals_one_process(schedule: str, override: list[list[str]] | None) -> None:
    _pipeline_llm(schedule, override)
