"""Optimizer and learning-rate scheduler containers."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from hp_trainer.config import LRSchedulerConfig, OptimizerConfig
from hp_trainer.muon import get_hyper_optimizer

_GATHER_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

__all__ = [
    "LRSchedulersContainer",
    "OptimizersContainer",
    "build_lr_schedulers",
    "build_optimizers",
    "lr_factor",
]


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


def lr_factor(step: int, total_steps: int, config: LRSchedulerConfig) -> float:
    """Multiplier of the peak learning rate used for optimizer step ``step`` (0-based).

    Linear warm-up ``(s) / (warmup + 1)`` for ``s = step + 1 <= warmup``; then stable at 1.0
    until the decay tail (the last ``decay_ratio`` of the post-warm-up steps), which follows the
    ``decay_type`` curve down to ``min_lr_factor``.

    Args:
        step: 0-based optimizer step.
        total_steps: Total optimizer steps of the run.
        config: The ``[lr_scheduler]`` section.

    Returns:
        The factor.

    See Also:
        :titan:`torchtitan.components.lr_scheduler.linear_warmup_stable_decay`.
    """
    s = step + 1
    warmup = config.warmup_steps
    if s <= warmup:
        return s / (warmup + 1)
    if config.decay_type == "constant":
        return 1.0
    ratio = config.decay_ratio
    if ratio is None:
        ratio = 0.2 if config.decay_type == "wsd" else 1.0
    decay_steps = max(round(ratio * (total_steps - warmup)), 0)
    stable_end = total_steps - decay_steps
    if decay_steps == 0 or s <= stable_end:
        return 1.0
    progress = min((s - stable_end) / (decay_steps + 1), 1.0)
    if config.decay_type in ("linear", "wsd"):
        curve = 1.0 - progress
    elif config.decay_type == "sqrt":
        curve = 1.0 - math.sqrt(progress)
    else:  # cosine
        curve = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_factor + (1.0 - config.min_lr_factor) * curve


class LRSchedulersContainer:
    """One ``LambdaLR`` per optimizer following :func:`lr_factor`.

    Args:
        optimizers: The optimizers container.
        total_steps: Total optimizer steps of the run.
        config: The ``[lr_scheduler]`` section.

    See Also:
        :titan:`torchtitan.components.lr_scheduler.LRSchedulersContainer`: TorchTitan's container.
    """

    def __init__(
        self, optimizers: OptimizersContainer, total_steps: int, config: LRSchedulerConfig
    ) -> None:
        self.total_steps = total_steps
        self.config = config
        self.schedulers = [
            LambdaLR(opt, lambda step: lr_factor(step, total_steps, config)) for opt in optimizers
        ]

    def step(self) -> None:
        """Advance every scheduler by one optimizer step.

        See Also:
            :pt:`torch.optim.lr_scheduler.LRScheduler.step`.
        """
        for sched in self.schedulers:
            sched.step()

    def get_last_lr(self) -> float:
        """Current learning rate of the first parameter group.

        Returns:
            The learning rate.

        See Also:
            :pt:`torch.optim.lr_scheduler.LRScheduler.get_last_lr`.
        """
        return float(self.schedulers[0].get_last_lr()[0])

    def state_dict(self) -> dict[str, int]:
        """Only the step counter is state (the schedule comes from the config).

        Returns:
            ``{"last_epoch": ...}``.

        See Also:
            :pt:`torch.optim.lr_scheduler.LRScheduler.state_dict`.
        """
        return {"last_epoch": int(self.schedulers[0].last_epoch)}


def build_lr_schedulers(
    optimizers: OptimizersContainer, total_steps: int, config: LRSchedulerConfig
) -> LRSchedulersContainer:
    """Create the learning-rate schedulers of all optimizers.

    Args:
        optimizers: The optimizers container.
        total_steps: Total optimizer steps.
        config: The ``[lr_scheduler]`` section.

    Returns:
        The container.

    See Also:
        :titan:`torchtitan.components.lr_scheduler.build_lr_schedulers`.
    """
    return LRSchedulersContainer(optimizers, total_steps, config)
