"""The MoE decoders' TP plan as it was written before their sharding tables (a test oracle).

Loaded by ``test_declarative_sharding.py`` in the workers; not part of hp-trainer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hp_tp import NoParallel
from hp_trainer._parallel_api import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


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
