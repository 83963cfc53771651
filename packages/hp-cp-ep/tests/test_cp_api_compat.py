"""The PyTorch-style CP API has PyTorch's signatures (extensions keyword-only, after them)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from torch.distributed.tensor import experimental as torch_experimental
from torch.distributed.tensor.experimental import _attention as torch_attention

import hp_cp_ep


def _params(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (hp_cp_ep.context_parallel, torch_experimental.context_parallel),
        (hp_cp_ep.context_parallel_unshard, torch_attention.context_parallel_unshard),
        (hp_cp_ep.set_rotate_method, torch_attention.set_rotate_method),
    ],
)
def test_signature_extends_pytorch(ours: Callable[..., Any], theirs: Callable[..., Any]) -> None:
    mine, torch_params = _params(ours), _params(theirs)
    assert mine[: len(torch_params)] == torch_params
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in mine[len(torch_params) :])


def test_hyperparallel_style_signature() -> None:
    params = _params(hp_cp_ep.ContextParallel.__init__)[1:]
    assert [(n, d) for n, _, d in params[:6]] == [
        ("seq_dim", 1),
        ("head_dim", 2),
        ("ulysses_degree", None),
        ("qkv_indices", (0, 1, 2)),
        ("qkv_kwarg_names", ()),
        ("load_balance", False),
    ]
    assert _params(hp_cp_ep.AsyncContextParallel.__init__) == _params(
        hp_cp_ep.ContextParallel.__init__
    )


def test_torchtitan_helper_lives_in_the_trainer() -> None:
    # TorchTitan's create_context_parallel_ctx is trainer glue: hp-trainer owns it (its
    # signature and cp = 3 parity are tested there, test_trainer_cp_parity.py).
    assert not hasattr(hp_cp_ep, "create_context_parallel_ctx")
