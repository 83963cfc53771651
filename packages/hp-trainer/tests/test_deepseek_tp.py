"""DeepSeek-V3 (multi-head latent attention) under tensor parallel trains like one process."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import Trainer


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(folder: str, local_bs: int, par: dict[str, Any], run: str) -> Any:
    torch.set_num_threads(1)
    job = _helpers().job(Path(folder), par, run=run, local_bs=local_bs, model="deepseek_v3")
    trainer = Trainer(job)
    widths: list[int] = []  # the query projection's output columns each step (local heads)
    wq = trainer.model.get_submodule("layers.0.attention.wq")
    wq.register_forward_hook(lambda _m, _a, out: widths.append(int(out.shape[-1])))
    try:
        losses = trainer.train()
        state = _helpers().full_state([trainer.model])
        return losses, trainer.grad_norms, state, sorted(set(widths))
    finally:
        trainer.close()


_LAYOUTS = {
    "tp2xdp2": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
    # experts over [ep, tp] (ep borrowed from dp_shard 2), the attention TP x FSDP
    "tp2xep2": {
        "data_parallel_shard_degree": 2,
        "tensor_parallel_degree": 2,
        "expert_parallel_degree": 2,
    },
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One process with the global batch of both layouts (dp 2 x local batch 2)."""
    return _train(str(tmp_path_factory.mktemp("deepseek_tp_ref")), 4, {}, "ref")


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_deepseek_v3_tensor_parallel_matches_single_process(
    tmp_path: Path, layout: str, reference: Any
) -> None:
    par = _LAYOUTS[layout]
    results = run_distributed(_train, 4, str(tmp_path), 2, par, "tp", timeout=180)
    ref_losses, ref_norms, ref_state, ref_rows = reference
    assert len(ref_losses) == 3
    assert ref_rows == [4 * 24]  # 4 heads of qk_nope 16 + qk_rope 8
    assert all(r[3] == [2 * 24] for r in results)  # 2 local heads per TP rank
    _helpers().assert_matches_reference(
        [r[:3] for r in results],
        (ref_losses, ref_norms, ref_state),
        each_rank_whole=True,
        norm_rtol=1e-5,
        norm_atol=1e-5,
    )
    # the routing bias moved identically; the shared latent projection was trained
    assert ref_state["layers.1.moe.expert_bias"].abs().sum() > 0


def test_deepseek_v3_tp_not_dividing_the_heads_fails_up_front(tmp_path: Path) -> None:
    from hp_trainer.distributed.layout_validation import validate_parallel_layout
    from hp_trainer.distributed.parallel_dims import ParallelDims
    from hp_trainer.models.common.expert_parallel import moe_layout_error
    from hp_trainer.protocols.model_spec import get_model_spec

    cfg = _helpers().job(tmp_path, {"tensor_parallel_degree": 3}, run="bad", model="deepseek_v3")
    with pytest.raises(ValueError, match="tensor_parallel_degree = 3 must divide"):
        validate_parallel_layout(cfg, 3)
    args = get_model_spec("deepseek_v3").flavors["tiny"]
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=3, pp=1, ep=1, world_size=3)
    assert moe_layout_error(dims, args) == (
        "parallelism.tensor_parallel_degree = 3 must divide the attention's 4 heads"
    )


def _query_lora_gradients(tp_degree: int) -> Any:
    """Loss and full gradients of deepseek_v3 tiny with a query LoRA rank, sharded over TP."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hp_trainer.models.common.expert_parallel import apply_moe_ep_tp, apply_tp_to_moe_decoder
    from hp_trainer.models.deepseek_v3 import DeepSeekV3, deepseek_v3_flavors
    from hp_trainer.models.deepseek_v3.parallelize import DEEPSEEK_V3_SHARDING

    torch.set_num_threads(1)
    torch.manual_seed(0)
    args = dataclasses.replace(deepseek_v3_flavors["tiny"], q_lora_rank=16)
    model = DeepSeekV3(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    if tp_degree > 1:
        mesh = init_device_mesh("cpu", (tp_degree,))
        apply_tp_to_moe_decoder(model, mesh, loss_parallel=False, sharding=DEEPSEEK_V3_SHARDING)
        apply_moe_ep_tp(model, mesh, None)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        grad = param.grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    if dist.is_initialized():
        assert isinstance(model.get_submodule("layers.0.attention.wq_a").weight, DTensor)
    return loss.detach(), grads


def test_query_lora_attention_gradients_match_single_process() -> None:
    ref_loss, ref_grads = _query_lora_gradients(1)
    for loss, grads in run_distributed(_query_lora_gradients, 2, 2, timeout=60):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert set(grads) == set(ref_grads)
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m, k=name: f"{k}: {m}"
            )
