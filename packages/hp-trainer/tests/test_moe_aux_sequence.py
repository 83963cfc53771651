"""DeepSeek-V3's sequence-wise aux loss in the trainer: dp_shard 4 x ep 2 equals one process.

The loss is selected on the model flavor (``MoEArgs(aux_loss_type="sequence")``); each data
parallel rank holds whole sequences and the sequence count is summed over the dp group, so the
sum of the ranks' shares and gradients is the loss of one process over every sequence.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import Trainer
from hp_trainer.protocols.model_spec import get_model_spec


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(folder: str, local_bs: int, par: dict[str, Any], run: str, kind: str) -> Any:
    config = _helpers().job(Path(folder), par, run=run, local_bs=local_bs, model="qwen3_moe")
    spec = get_model_spec("qwen3_moe")
    tiny = spec.flavors["tiny"]
    moe_args = dataclasses.replace(tiny.moe_args, aux_loss_coeff=0.1, aux_loss_type=kind)
    spec.flavors["tiny"] = dataclasses.replace(tiny, moe_args=moe_args)
    try:
        trainer = Trainer(config)
    finally:
        spec.flavors["tiny"] = tiny
    try:
        losses = trainer.train()
        state = _helpers().full_state(trainer.model_parts)
        return losses, trainer.grad_norms, state
    finally:
        trainer.close()


def test_sequence_aux_loss_dp4_ep2_matches_single_process(tmp_path: Path) -> None:
    par = {"data_parallel_shard_degree": 4, "expert_parallel_degree": 2}
    results = run_distributed(_train, 4, str(tmp_path), 1, par, "dp", "sequence", timeout=180)
    reference = _train(str(tmp_path), 4, {}, "r", "sequence")
    _helpers().assert_matches_reference(
        results, reference, each_rank_whole=True, norm_rtol=1e-5, norm_atol=1e-5
    )
    # the sequence-wise loss trains the routers differently from the batch-wise one
    batch = _train(str(tmp_path), 4, {}, "b", "batch")[2]
    gate = "layers.0.moe.router.gate.weight"
    assert (batch[gate] - reference[2][gate]).abs().max() > 1e-6


def test_sequence_aux_loss_with_context_parallel_is_refused() -> None:
    from hp_trainer.distributed.parallel_dims import ParallelDims
    from hp_trainer.models.common.expert_parallel import moe_layout_error

    tiny = get_model_spec("qwen3_moe").flavors["tiny"]
    seq = dataclasses.replace(
        tiny,
        moe_args=dataclasses.replace(tiny.moe_args, aux_loss_coeff=0.1, aux_loss_type="sequence"),
    )
    batch = dataclasses.replace(
        tiny, moe_args=dataclasses.replace(tiny.moe_args, aux_loss_coeff=0.1)
    )
    cp2 = ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1, ep=2, world_size=4)
    dp4 = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=2, world_size=4)
    assert moe_layout_error(cp2, seq) == (
        "the model's aux_loss_type = 'sequence' with context_parallel_degree = 2: the "
        "sequence-wise auxiliary loss needs whole sequences on each rank; expected "
        "aux_loss_type = 'batch' or context_parallel_degree = 1"
    )
    assert moe_layout_error(cp2, batch) is None
    assert moe_layout_error(dp4, seq) is None


def test_moe_aux_loss_type_option_sets_the_flavor_and_is_checked_at_parse_time() -> None:
    from hp_trainer.components.hf_io.config import resolve_model_args
    from hp_trainer.config import ConfigManager

    manager = ConfigManager()
    base = ["--model.flavor", "tiny", "--training.seq_len", "32"]
    for model in ("qwen3_moe", "deepseek_v3"):
        spec = get_model_spec(model)
        flavor = spec.model_args("tiny")
        for kind in ("batch", "sequence"):
            cfg = manager.parse_args(["--model.name", model, *base, "--moe.aux_loss_type", kind])
            want = dataclasses.replace(
                flavor, moe_args=dataclasses.replace(flavor.moe_args, aux_loss_type=kind)
            )
            assert resolve_model_args(spec, cfg) == want
        cfg = manager.parse_args(["--model.name", model, *base])
        assert resolve_model_args(spec, cfg) == flavor  # "model": the flavor's own choice
    with pytest.raises(ValueError, match=r"moe\.aux_loss_type = 'sequence'.*context_parallel"):
        manager.parse_args(
            ["--moe.aux_loss_type", "sequence", "--parallelism.context_parallel_degree", "2"]
        )
    with pytest.raises(ValueError, match="expected one of 'model', 'batch', 'sequence'"):
        manager.parse_args(["--moe.aux_loss_type", "tokens"])
    cfg = manager.parse_args(["--model.name", "llama3", *base, "--moe.aux_loss_type", "batch"])
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        resolve_model_args(get_model_spec("llama3"), cfg)
