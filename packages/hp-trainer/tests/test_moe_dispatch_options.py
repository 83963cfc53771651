"""``--moe.dedup_dispatch`` / ``--moe.overlap_backward``: the trainer's switches for hp-cp-ep's
de-duplicating dispatcher and overlapped backward all-to-all.

Lean: the tiny Qwen 3 MoE (top-k > 1), EP borrowed from FSDP on 2 and 4 ranks (and EP 2 x TP 2:
``ExpertTensorParallel`` on ``[ep, tp]``), 3 steps, against the same job with the plain
dispatcher (that job is itself checked against one process in ``test_trainer_ep_parity.py``).
The switched job must install the dedup dispatcher with the overlap on every MoE layer, send
fewer all-to-all bytes (a token bound for two experts on one rank crosses once) and train the
same within 1e-6 (losses, gradient norms, weights).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_cp_ep import DedupTokenDispatcher, MoE
from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import JobConfig, Trainer
from hp_trainer.distributed.layout_validation import validate_parallel_layout


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(folder: str, switched: bool, ranks_per_node: int = 1, tp: int = 1) -> Any:
    world = dist.get_world_size()
    ep = world // tp  # with TP, EP borrows from FSDP alone: dp_shard = ep
    parallelism = {
        "data_parallel_shard_degree": ep,
        "expert_parallel_degree": ep,
        "tensor_parallel_degree": tp,
    }
    cfg: JobConfig = _helpers().job(
        Path(folder), parallelism, run=f"dispatch{int(switched)}", model="qwen3_moe", steps=3
    )
    cfg.moe.dedup_dispatch = switched
    cfg.moe.overlap_backward = switched
    cfg.moe.dedup_ranks_per_node = ranks_per_node if switched else 1
    trainer = Trainer(cfg)
    sent = [0]
    all_to_all_single = dist.all_to_all_single
    signature = inspect.signature(all_to_all_single)
    me, node = dist.get_rank(), ranks_per_node

    def counting(*args: Any, **kwargs: Any) -> Any:
        # bytes leaving this rank's node (nodes of `ranks_per_node` consecutive ranks; 1: every
        # other rank is another node), from the splits each call is given
        call = signature.bind(*args, **kwargs).arguments
        tensor, group = call["input"], call.get("group")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        splits = call.get("input_split_sizes") or [tensor.shape[0] // len(ranks)] * len(ranks)
        row_bytes = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
        sent[0] += sum(
            n * row_bytes for r, n in zip(ranks, splits, strict=True) if r // node != me // node
        )
        return all_to_all_single(*args, **kwargs)

    dist.all_to_all_single = counting  # every EP exchange (dispatch, combine, both backwards)
    try:
        losses = trainer.train()
        state = _helpers().full_state([trainer.model])
        kinds = set()
        for module in trainer.model.modules():
            if isinstance(module, MoE):
                dispatcher = module.experts.token_dispatcher
                nodes = getattr(dispatcher, "intra_size", None)
                tp_ranks = (
                    dist.get_world_size(dispatcher.tp_group)
                    if dispatcher.tp_group is not None
                    else 1
                )
                kinds.add((type(dispatcher).__name__, dispatcher.overlap_backward, nodes, tp_ranks))
        return losses, list(trainer.grad_norms), state, kinds, sent[0]
    finally:
        dist.all_to_all_single = all_to_all_single
        trainer.close()


@pytest.mark.parametrize(("world", "ranks_per_node", "tp"), [(2, 1, 1), (4, 2, 1), (4, 1, 2)])
def test_dedup_and_overlap_switches_train_like_plain_dispatch(
    tmp_path: Path, world: int, ranks_per_node: int, tp: int
) -> None:
    """EP 2 one stage; EP 4 as 2 nodes of 2 ranks (two-stage dispatch on a 2-D EP mesh); EP 2 x
    TP 2 (``ExpertTensorParallel(dedup=True, overlap_backward=True)``)."""
    args = (str(tmp_path), ranks_per_node, tp)
    plain = run_distributed(_train, world, args[0], False, *args[1:], timeout=180)
    switched = run_distributed(_train, world, args[0], True, *args[1:], timeout=180)
    for (losses, norms, state, kinds, sent), (
        ref_losses,
        ref_norms,
        ref_state,
        ref_kinds,
        ref_sent,
    ) in zip(switched, plain, strict=True):
        assert ref_kinds == {("TokenDispatcher", False, None, tp)}, ref_kinds
        assert kinds == {(DedupTokenDispatcher.__name__, True, ranks_per_node, tp)}, kinds
        assert len(norms) == len(losses) == 3
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=0, atol=1e-6)
        # off-node bytes: rows of (dim + 2k) elements once per (token, node) against dim per
        # routed choice
        assert sent < 0.95 * ref_sent, (sent, ref_sent)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-6
        )
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("parallelism", "expected"),
    [
        ({"data_parallel_shard_degree": 2}, "expert_parallel_degree = 1"),
    ],
)
def test_dispatch_switches_refused_without_ep(
    tmp_path: Path, parallelism: dict[str, int], expected: str
) -> None:
    cfg: JobConfig = _helpers().job(tmp_path, parallelism, run="refused", model="qwen3_moe")
    cfg.moe.dedup_dispatch = True
    with pytest.raises(ValueError, match=r"moe\.dedup_dispatch = true") as info:
        validate_parallel_layout(cfg, 2)
    assert expected in str(info.value)


def test_node_axis_refused_with_tensor_parallel(tmp_path: Path) -> None:
    """EP x TP takes the dedup dispatch (one stage); its [ep, tp] mesh has no node axis."""
    parallelism = {
        "data_parallel_shard_degree": 4,
        "tensor_parallel_degree": 2,
        "expert_parallel_degree": 4,
    }
    cfg: JobConfig = _helpers().job(tmp_path, parallelism, run="refused", model="qwen3_moe")
    cfg.moe.dedup_dispatch = True
    cfg.moe.dedup_ranks_per_node = 2
    with pytest.raises(ValueError, match=r"dedup_ranks_per_node = 2 with tensor_parallel_degree"):
        validate_parallel_layout(cfg, 8)
    cfg.moe.dedup_ranks_per_node = 1
    validate_parallel_layout(cfg, 8)  # one stage under EP x TP: accepted
