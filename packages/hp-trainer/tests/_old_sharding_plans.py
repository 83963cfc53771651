"""The families' TP / EP / CP plans as they were written before their sharding tables (a test
oracle): the dense and MoE TP plans block by block, the routed experts block by block, the
RoPE table sharded by name, and the two parallelize recipes around them.

Loaded by ``test_declarative_sharding.py`` in the workers; not part of hp-trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hp_cp_ep import ExpertParallel, ExpertTensorParallel, TensorParallel
from hp_cp_ep.cp import context_parallel
from hp_tp import NoParallel
from hp_trainer._parallel_api import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from hp_trainer.distributed.activation_checkpoint import apply_ac
from hp_trainer.distributed.compile import apply_compile
from hp_trainer.distributed.fsdp import apply_fsdp_to_decoder, disable_fsdp_gradient_division
from hp_trainer.models.common.expert_parallel import moe_layout_error
from hp_trainer.models.common.parallelize import MIXED_PRECISION_DTYPES


def _replicate_tokens(moe: nn.Module, tp_mesh: Any) -> None:
    def gather(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)
        return (x.redistribute(tp_mesh, [Replicate()]).to_local(), *args[1:])

    def shard(_m: nn.Module, _a: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        full = DTensor.from_local(out, tp_mesh, [Replicate()], run_check=False)
        return full.redistribute(tp_mesh, [Shard(1)]).to_local()

    moe.register_forward_pre_hook(gather)
    moe.register_forward_hook(shard)


def _latent(attention: nn.Module, tp_mesh: Any) -> None:
    plan: dict[str, Any] = {
        "wkv_a": NoParallel(),
        "kv_norm": NoParallel(),
        "wkv_b": ColwiseParallel(),
        "wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if getattr(attention, "wq", None) is not None:
        plan["wq"] = ColwiseParallel()
    else:
        plan.update({"wq_a": NoParallel(), "q_norm": NoParallel(), "wq_b": ColwiseParallel()})
    parallelize_module(attention, tp_mesh, plan)
    size = attention.kv_lora_rank

    def hook(_m: nn.Module, _a: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        latent, k_rope = out[..., :size], out[..., size:]
        shared = DTensor.from_local(k_rope, tp_mesh, [Replicate()], run_check=False)
        return torch.cat([latent, shared.to_local(grad_placements=[Partial()])], dim=-1)

    attention.get_submodule("wkv_a").register_forward_hook(hook)


def apply_tp_to_moe_decoder(model: nn.Module, tp_mesh: Any, loss_parallel: bool, **_: Any) -> None:
    """The old imperative plan: trunk, then block by block."""
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if getattr(model, k, None)})
    for block in model.get_submodule("layers").children():
        latent = hasattr(block.get_submodule("attention"), "wkv_a")
        plan: dict[str, Any] = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None),
                desired_input_layouts=(Replicate(), None),
                use_local_output=latent,
            ),
            "ffn_norm": SequenceParallel(),
        }
        if latent:
            _latent(block.get_submodule("attention"), tp_mesh)
        else:
            plan["attention.wq"] = ColwiseParallel()
            plan["attention.wk"] = ColwiseParallel()
            plan["attention.wv"] = ColwiseParallel()
            plan["attention.wo"] = RowwiseParallel(output_layouts=Shard(1))
        if not latent and getattr(block.get_submodule("attention"), "q_norm", None) is not None:
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if not getattr(block, "moe_enabled", False):
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan["feed_forward.w1"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
            plan["feed_forward.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)
        if getattr(block, "moe_enabled", False):
            moe = block.get_submodule("moe")
            parallelize_module(moe.get_submodule("router.gate"), tp_mesh, NoParallel())
            if getattr(moe, "shared_experts", None) is not None:
                parallelize_module(moe.get_submodule("shared_experts"), tp_mesh, NoParallel())
            _replicate_tokens(moe, tp_mesh)


def apply_dense_tp(model: nn.Module, tp_mesh: Any, loss_parallel: bool) -> None:
    """The dense plan as it was written before the table."""
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if getattr(model, k, None)})
    for block in model.get_submodule("layers").children():
        plan: dict[str, Any] = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        if getattr(block.get_submodule("attention"), "q_norm", None) is not None:
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)


def apply_moe_ep_tp(
    model: nn.Module, tp_mesh: Any, ep_mesh: Any, ep_etp_mesh: Any = None, etp: bool = False
) -> None:
    """The routed experts, block by block, as before the table's ``ep`` section."""
    for block in model.get_submodule("layers").children():
        if not getattr(block, "moe_enabled", False):
            continue
        experts = block.get_submodule("moe.experts")
        if ep_mesh is not None and etp:
            parallelize_module(experts, ep_etp_mesh, ExpertTensorParallel())
        elif ep_mesh is not None:
            parallelize_module(experts, ep_mesh, ExpertParallel())
        elif tp_mesh is not None:
            parallelize_module(experts, tp_mesh, TensorParallel())


def _fsdp(model: nn.Module, dims: Any, cfg: Any, edp_mesh: Any) -> None:
    training, par = cfg.training, cfg.parallelism
    apply_fsdp_to_decoder(
        model,
        dims.get_mesh("fsdp_mesh"),
        param_dtype=MIXED_PRECISION_DTYPES[training.mixed_precision_param],
        reduce_dtype=MIXED_PRECISION_DTYPES[training.mixed_precision_reduce],
        pp_enabled=dims.pp_enabled,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=par.fsdp_reshard_after_forward,
        ep_degree=dims.ep,
        edp_mesh=edp_mesh,
        enable_symm_mem=par.enable_symm_mem,
    )
    disable_fsdp_gradient_division(model)


def parallelize_dense_decoder(model: nn.Module, dims: Any, cfg: Any) -> nn.Module:
    """The dense recipe before the table: imperative TP, AC, compile, FSDP."""
    if dims.tp_enabled:
        apply_dense_tp(
            model, dims.get_mesh("tp"), loss_parallel=not cfg.parallelism.disable_loss_parallel
        )
    if cfg.activation_checkpoint.mode != "none":
        apply_ac(model, cfg.activation_checkpoint)
    if cfg.compile.enable:
        apply_compile(model, cfg.compile, inside_checkpoint=dims.cp_enabled)
    if dims.dp_enabled or dims.cp_enabled:
        _fsdp(model, dims, cfg, dims.get_optional_mesh("efsdp"))
    return model


def parallelize_moe_decoder(model: nn.Module, dims: Any, cfg: Any) -> nn.Module:
    """The MoE recipe before the table: imperative TP, experts block by block, AC, FSDP."""
    problem = moe_layout_error(dims, model.args)
    if problem is not None:
        raise ValueError(problem)
    edp_mesh = dims.get_mesh("efsdp_mesh") if dims.ep_enabled else None
    if dims.tp_enabled:
        tp_mesh = dims.get_mesh("tp")
        apply_tp_to_moe_decoder(model, tp_mesh, not cfg.parallelism.disable_loss_parallel)
        if dims.ep_enabled:
            world = dims.get_mesh("world")
            split = world._unflatten(
                2, (dims.dp_shard // dims.ep, dims.ep), ("etp_efsdp", "etp_ep")
            )
            edp_mesh = (
                split["dp_replicate", "etp_efsdp"] if dims.dp_replicate > 1 else split["etp_efsdp"]
            )
            ep_tp = split["etp_ep", "tp"]
            apply_moe_ep_tp(model, tp_mesh, ep_tp["etp_ep"], ep_tp, etp=True)
        else:
            apply_moe_ep_tp(model, tp_mesh, None)
    elif dims.ep_enabled:
        apply_moe_ep_tp(model, None, dims.get_mesh("ep"))
    if dims.dp_degree * dims.cp > 1:
        loss_group = dims.get_mesh("dp_cp").get_group()
        for block in model.get_submodule("layers").children():
            moe = getattr(block, "moe", None)
            if moe is not None:
                moe.aux_loss_group = loss_group
    if cfg.activation_checkpoint.mode != "none":
        apply_ac(model, cfg.activation_checkpoint)
    if cfg.compile.enable:
        apply_compile(model, cfg.compile, inside_checkpoint=dims.cp_enabled)
    if dims.dp_enabled or dims.cp_enabled:
        _fsdp(model, dims, cfg, edp_mesh)
    return model


@contextlib.contextmanager
def sharded(
    self: Any,
    model_parts: list[nn.Module],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    document_ids: torch.Tensor | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``ContextParallelStep.sharded`` before the table: every part's ``rope_cache`` by name."""
    seq = inputs.shape[1]
    tables = [part.get_buffer("rope_cache") for part in model_parts]
    try:
        for part, table in zip(model_parts, tables, strict=True):
            part.rope_cache = self.shard(table[:seq], 0)
        with context_parallel(
            self.mesh, mode=self.mode, load_balance=True, document_ids=document_ids
        ):
            yield self.shard(inputs, 1), self.shard(labels, 1)
    finally:
        for part, table in zip(model_parts, tables, strict=True):
            part.rope_cache = table
