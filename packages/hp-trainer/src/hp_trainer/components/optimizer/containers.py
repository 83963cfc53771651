"""The optimizers container: one optimizer per model part, stepped and zeroed together."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hp_trainer.components.optimizer.muon import get_hyper_optimizer
from hp_trainer.config import OptimizerConfig

_GATHER_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

__all__ = ["OptimizersContainer", "build_optimizers"]


class OptimizersContainer:
    """One optimizer per model part, stepped and zeroed together.

    ``optimizer.name = "Muon"`` builds :func:`~hp_trainer.get_hyper_optimizer` per part
    (Muon on hidden matrices and expert weights, AdamW on the rest, in one optimizer; the update
    shards travel to each matrix's owner rank in ``optimizer.muon_gather_dtype``).

    Args:
        model_parts: The model chunks (one for non-pipelined training).
        optimizer_config: The ``[optimizer]`` section.

    See Also:
        :titan:`torchtitan.components.optimizer.OptimizersContainer`: TorchTitan's container.
    """

    def __init__(self, model_parts: Iterable[nn.Module], optimizer_config: OptimizerConfig) -> None:
        self.model_parts = list(model_parts)
        cfg = optimizer_config
        if cfg.name == "Muon":
            self.optimizers: list[torch.optim.Optimizer] = [
                get_hyper_optimizer(
                    part,
                    lr=cfg.lr,
                    weight_decay=cfg.weight_decay,
                    adamw_betas=(cfg.beta1, cfg.beta2),
                    adamw_eps=cfg.eps,
                    gather_dtype=_GATHER_DTYPES[cfg.muon_gather_dtype],
                )
                for part in self.model_parts
            ]
            return
        kwargs: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
        if cfg.implementation == "fused":
            kwargs["fused"] = True
        elif cfg.implementation == "foreach":
            kwargs["foreach"] = True
        else:
            kwargs["foreach"] = False
        cls: type[torch.optim.Optimizer]
        if cfg.name in ("AdamW", "Adam"):
            kwargs.update(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
            cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
        else:
            cls = torch.optim.SGD
        self.optimizers = [
            cls([p for p in part.parameters() if p.requires_grad], **kwargs)
            for part in self.model_parts
        ]

    def step(self) -> None:
        """Step every optimizer.

        See Also:
            :pt:`torch.optim.Optimizer.step`.
        """
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every optimizer.

        Args:
            set_to_none: Free gradients instead of zeroing them.

        See Also:
            :pt:`torch.optim.Optimizer.zero_grad`.
        """
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def __iter__(self) -> Any:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def state_dict(self) -> list[dict[str, Any]]:
        """Return each optimizer's state dict.

        Returns:
            One state dict per model part.

        See Also:
            :pt:`torch.optim.Optimizer.state_dict`.
        """
        return [opt.state_dict() for opt in self.optimizers]


def build_optimizers(
    model_parts: Iterable[nn.Module], optimizer_config: OptimizerConfig
) -> OptimizersContainer:
    """Create the optimizers of all model parts.

    Args:
        model_parts: The model chunks.
        optimizer_config: The ``[optimizer]`` section.

    Returns:
        The container.

    See Also:
        :titan:`torchtitan.components.optimizer.build_optimizers`.
    """
    return OptimizersContainer(model_parts, optimizer_config)
