"""Callbacks: what runs around the training loop, built-in (metrics, profiling) or the user's.

A callback is any object with some of the hooks of :class:`Callback` (subclassing it gives the
others as no-ops). The trainer calls every callback's hook in order: the built-in ones first
(:class:`MetricsCallback`, which also feeds TensorBoard and W&B, then :class:`ProfilerCallback`),
then those of ``job.callbacks`` (``--job.callbacks my_pkg.hooks:EarlyStop``), each built with no
argument. The loop itself knows no metrics, profiler or logger: it only calls the hooks.

Values a step computes stay on the device until the trainer reads them (on log, validation and
checkpoint steps): :meth:`Callback.on_step_end` gets none, :meth:`Callback.on_step_values` gets
each step's loss and gradient norm once read, in step order.

See Also:
    HyperParallel's trainer callbacks; ``transformers.TrainerCallback``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hp_trainer.components.metrics import MetricsProcessor
    from hp_trainer.components.profiling import StepProfiler
    from hp_trainer.trainer import BaseTrainer

__all__ = [
    "HOOKS",
    "Callback",
    "CallbackList",
    "MetricsCallback",
    "ProfilerCallback",
    "load_callback_class",
]


class Callback:
    """The hooks the trainer calls; every one does nothing here.

    Subclass it and override the hooks you need, or write any class with some of these methods.
    ``trainer`` is the running :class:`hp_trainer.BaseTrainer`.

    See Also:
        ``transformers.TrainerCallback``: the same idea in HF's trainer.
    """

    def on_train_begin(self, trainer: BaseTrainer) -> None:
        """Before the first step (after a resume: ``trainer.step`` is the resumed step)."""

    def on_step_begin(self, trainer: BaseTrainer, step: int) -> None:
        """Before step ``step`` (1-based) runs."""

    def on_step_end(self, trainer: BaseTrainer, step: int) -> None:
        """After step ``step``'s optimizer step; its values may not be read yet."""

    def on_step_values(
        self, trainer: BaseTrainer, step: int, loss: float, grad_norm: float
    ) -> None:
        """Step ``step``'s global loss and gradient norm, once the trainer read them."""

    def on_log(self, trainer: BaseTrainer, step: int, record: dict[str, Any]) -> None:
        """On a log step: ``record`` holds ``loss``, ``grad_norm``, ``lr`` and the trainer's
        extra fields (e.g. the MoE expert load)."""

    def on_validation_end(
        self, trainer: BaseTrainer, step: int, loss: float, perplexity: float
    ) -> None:
        """After a validation run at step ``step``."""

    def on_save(self, trainer: BaseTrainer, step: int) -> None:
        """After a checkpoint of step ``step`` was written (or, asynchronously, started)."""

    def on_train_end(self, trainer: BaseTrainer) -> None:
        """When the loop ends (finished, stopped by SIGTERM, or failed)."""


HOOKS = tuple(
    name for name, _ in inspect.getmembers(Callback, inspect.isfunction) if name.startswith("on_")
)
"""The hook names a callback may define."""


def load_callback_class(spec: str) -> type:
    """Import ``module:Class`` and check that it is a callback class.

    Args:
        spec: ``"package.module:ClassName"``.

    Returns:
        The class.

    Raises:
        ValueError: ``spec`` is not ``module:Class``, the module or the name does not exist, or
            the class defines none of :data:`HOOKS`.
        TypeError: The name is not a class.
    """
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name or ":" in class_name:
        raise ValueError(f"a callback is given as 'module:Class', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"callback {spec!r}: cannot import {module_name!r} ({exc})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"callback {spec!r}: module {module_name!r} has no {class_name!r}")
    if not inspect.isclass(cls):
        raise TypeError(f"callback {spec!r} must name a class, got a {type(cls).__name__}")
    if not any(callable(getattr(cls, hook, None)) for hook in HOOKS):
        raise ValueError(
            f"callback {spec!r} defines none of the hooks {', '.join(HOOKS)} (subclass "
            "hp_trainer.Callback)"
        )
    return cls


class CallbackList:
    """Calls one hook on every callback, in order; a callback without the hook is skipped.

    Args:
        callbacks: The callbacks.
    """

    def __init__(self, callbacks: Iterable[Any] = ()) -> None:
        self.callbacks = list(callbacks)

    def append(self, callback: Any) -> None:
        """Add a callback after the others."""
        self.callbacks.append(callback)

    def call(self, hook: str, *args: Any) -> None:
        """Run ``hook(*args)`` on every callback that has it.

        Raises:
            ValueError: ``hook`` is not one of :data:`HOOKS`.
        """
        if hook not in HOOKS:
            raise ValueError(f"unknown callback hook {hook!r}; hooks: {', '.join(HOOKS)}")
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)

    def __iter__(self) -> Any:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)


class MetricsCallback(Callback):
    """The built-in metrics: console line, JSONL, TensorBoard, W&B and the loss plot.

    Args:
        metrics: The trainer's :class:`hp_trainer.MetricsProcessor`.
    """

    def __init__(self, metrics: MetricsProcessor) -> None:
        self.metrics = metrics
        self.plot: Any = None
        """The loss plot written when the run ended, or None."""

    def on_train_begin(self, trainer: BaseTrainer) -> None:
        """Start the run's outputs (resuming their history at ``trainer.step``)."""
        self.metrics.start(trainer.step)

    def on_step_values(
        self, trainer: BaseTrainer, step: int, loss: float, grad_norm: float
    ) -> None:
        """Add the step to the loss curve."""
        self.metrics.observe_loss(step, loss)

    def on_log(self, trainer: BaseTrainer, step: int, record: dict[str, Any]) -> None:
        """Write the step line and record."""
        fields = {k: v for k, v in record.items() if k not in ("loss", "grad_norm", "lr")}
        self.metrics.log(
            step, record["loss"], record["grad_norm"], record["lr"], extra=fields or None
        )

    def on_validation_end(
        self, trainer: BaseTrainer, step: int, loss: float, perplexity: float
    ) -> None:
        """Write the validation line and record."""
        self.metrics.log_validation(step, loss, perplexity)

    def on_train_end(self, trainer: BaseTrainer) -> None:
        """Close the outputs (the loss plot is drawn here)."""
        self.plot = self.metrics.close()


class ProfilerCallback(Callback):
    """The built-in profiler: ``[profiling]``'s traces and memory snapshots of a step window.

    Args:
        factory: Builds the :class:`~hp_trainer.components.profiling.StepProfiler` when the
            run starts.
    """

    def __init__(self, factory: Any) -> None:
        self.factory = factory
        self.profiler: StepProfiler | None = None
        """The profiler of the current run."""

    def on_train_begin(self, trainer: BaseTrainer) -> None:
        """Start a profiler for this run."""
        self.profiler = self.factory()

    def on_step_end(self, trainer: BaseTrainer, step: int) -> None:
        """Advance the profiler's schedule."""
        if self.profiler is not None:
            self.profiler.step()

    def on_train_end(self, trainer: BaseTrainer) -> None:
        """Write what the window recorded."""
        if self.profiler is not None:
            self.profiler.close()
