"""Trainer AC modes swap and memory_budget: saved-tensor counts, parity with eager, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_trainer import (
    ActivationCheckpointConfig,
    CompileConfig,
    Decoder,
    DecoderArgs,
    apply_ac,
    apply_compile,
    parse_args,
)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Stack(nn.Module):
    def __init__(self, n: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Block() for i in range(n)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _run(budget: float | None) -> tuple[list[bool], torch.Tensor, list[torch.Tensor]]:
    """Saved tensors (True: an activation, False: a graph input), output, input gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Stack()
    if budget is not None:
        apply_ac(model, ActivationCheckpointConfig(mode="memory_budget", memory_budget=budget))
        apply_compile(model, CompileConfig(backend="aot_eager_decomp_partition"))
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.square().mean().backward()
    grads = [x.grad, *(p.grad for p in model.parameters())]
    inputs = {t.untyped_storage().data_ptr() for t in (x, *model.parameters())}
    is_activation = [t.untyped_storage().data_ptr() not in inputs for t in saved]
    return is_activation, out, grads  # type: ignore[return-value]


def test_memory_budget_zero_recomputes_everything_one_saves_everything() -> None:
    eager_saved, eager_out, eager_grads = _run(None)
    budget_results = {b: _run(b) for b in (0.0, 1.0)}
    for _saved, out, grads in budget_results.values():
        torch.testing.assert_close(out, eager_out)
        for got, want in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want)
    # budget 0: only graph inputs (x and the parameters) are kept, every activation is
    # recomputed; budget 1: as many activations are kept as eager autograd keeps
    assert not any(budget_results[0.0][0])
    assert sum(budget_results[1.0][0]) == sum(eager_saved) > 0
    # the setting was scoped to the block's call
    assert _budget_untouched()


def _budget_untouched() -> bool:
    import torch._functorch.config as functorch_config

    return functorch_config.activation_memory_budget == 1.0


def test_config_modes_and_bad_input() -> None:
    cfg = parse_args(
        [
            "--activation_checkpoint.mode",
            "memory_budget",
            "--activation_checkpoint.memory_budget",
            "0.25",
            "--compile.enable",
            "true",
        ]
    )
    assert cfg.activation_checkpoint.memory_budget == 0.25
    with pytest.raises(ValueError, match=r"memory_budget = 1\.5"):
        ActivationCheckpointConfig(mode="memory_budget", memory_budget=1.5)
    with pytest.raises(ValueError, match=r"memory_budget = -0\.1"):
        parse_args(["--activation_checkpoint.memory_budget", "-0.1"])
    with pytest.raises(ValueError, match=r"compile\.enable"):
        parse_args(["--activation_checkpoint.mode", "memory_budget"])
    with pytest.raises(ValueError, match="every_n_layers"):
        ActivationCheckpointConfig(mode="swap", every_n_layers=0)


def test_swap_mode_swaps_selected_blocks_with_one_manager() -> None:
    torch.manual_seed(0)
    args = DecoderArgs(dim=16, n_layers=4, n_heads=2, vocab_size=64, multiple_of=16)
    reference = Decoder(args)
    torch.manual_seed(0)
    model = Decoder(args)
    apply_ac(model, ActivationCheckpointConfig(mode="swap", every_n_layers=2))
    assert list(model.state_dict()) == list(reference.state_dict())  # hooks, no wrapper
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    for m in (reference, model):
        m(tokens).float().logsumexp(-1).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]
    managers = {
        hook.__self__.manager  # type: ignore[union-attr]
        for block in model.layers.values()
        for hook in block._forward_pre_hooks.values()
    }
    (manager,) = managers
    # blocks 1 and 3 are swapped (groups 0 and 1), block 1's loads prefetched in block 3's backward
    assert len(manager.groups) == 2
    # (the last group is loaded on demand, the one before it ahead of its backward)
    assert [e for e in manager.log if e[0] in ("load", "backward")] == [
        ("backward", 1),
        ("load", 1),
        ("load", 0),
        ("backward", 0),
    ]


def test_swap_mode_under_torch_compile() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, reference = _Stack(2), _Stack(2)
    reference.load_state_dict(model.state_dict())
    apply_ac(model, ActivationCheckpointConfig(mode="swap"))
    apply_compile(model, CompileConfig(backend="aot_eager"))
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(2))
    for m in (reference, model):
        m(x).square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    (hook,) = model.layers["0"]._forward_pre_hooks.values()
    groups = hook.__self__.manager.groups  # type: ignore[attr-defined]
    # the compiled graphs' saved tensors went through the swap hooks
    assert len(groups) == 2
    assert all(g.packs > 0 and g.unpacks == g.packs for g in groups)
