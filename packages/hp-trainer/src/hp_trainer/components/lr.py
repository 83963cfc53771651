"""Learning-rate schedules: warm-up then decay, one scheduler per optimizer of the container."""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR

from hp_trainer.components.optimizer.containers import OptimizersContainer
from hp_trainer.config import LRSchedulerConfig

__all__ = ["LRSchedulersContainer", "build_lr_schedulers", "lr_factor"]


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
