"""Per-step metrics: console line with a progress bar, JSONL, TensorBoard and a loss plot."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Literal, TextIO

import torch

from hp_dtensor import device as hp_device
from hp_trainer.components.expert_load import format_expert_load
from hp_trainer.config import MetricsConfig

__all__ = ["MetricsProcessor", "get_peak_flops", "logger"]

logger = logging.getLogger("hp_trainer")
"""The logger of hp-trainer (``hp_trainer``)."""

# Dense bf16 peak FLOP/s of one device, matched against the device name.
_PEAK_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("MI300X", 1307e12),
    ("Ascend910B", 376e12),
]


def get_peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device, looked up by name.

    Args:
        device_name: The device name (e.g. ``"NVIDIA H100 80GB HBM3"``).

    Returns:
        FLOP/s, or None when unknown (CPUs, unlisted devices).

    See Also:
        :titan:`torchtitan.tools.utils.get_peak_flops`: TorchTitan's table.
    """
    compact = device_name.replace(" ", "")
    for key, flops in _PEAK_FLOPS:
        if key in compact:
            return flops
    return None


def _device_name() -> str:
    kind = hp_device.get_device_type()
    if not hp_device.is_accelerator(kind):
        return kind
    module = getattr(torch, kind, None)
    get_name = getattr(module, "get_device_name", None)
    return str(get_name()) if get_name is not None else kind


def _start_wandb(run_folder: Path, resume_step: int) -> Any:
    """A W&B run in ``run_folder/wandb``; a resumed run continues the id kept in the folder."""
    try:
        # by name: an optional package, whose types the type check must not need
        wandb = importlib.import_module("wandb")
    except ImportError as exc:
        raise ImportError(
            "metrics.enable_wandb needs Weights & Biases: pip install 'hp-trainer[wandb]'"
        ) from exc
    id_file = run_folder / "wandb_run_id"
    if resume_step > 0 and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:8]  # W&B's id format: 8 lowercase alphanumerics
        id_file.write_text(run_id + "\n")
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "hp-trainer"),
        name=run_folder.name,
        id=run_id,
        resume="allow",
        dir=str(run_folder),
    )


def _parse_loss_line(line: str) -> tuple[int, float]:
    step, loss = line.split("\t")
    return int(step), float(loss)


def _history_until(path: Path, last_step: int, parse: Any) -> list[str]:
    """Keep the lines of ``path`` whose step (first item of ``parse(line)``) <= ``last_step``.

    The file is rewritten atomically; the kept lines are returned (none when it is missing).
    A torn last line (the earlier part of the run was killed mid-write) is dropped.
    """
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            step = int(parse(line)[0])
        except (ValueError, KeyError, IndexError):
            continue
        if step <= last_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    return kept


def _bar(fraction: float, width: int = 24) -> str:
    filled = round(fraction * width)
    return "[" + "#" * filled + "-" * (width - filled) + f"] {fraction * 100:5.1f}%"


class MetricsProcessor:
    """Collect and log per-step metrics.

    Logs on the first step, every ``log_freq`` steps and the last step: a console line (rank 0
    unless ``rank_0_only=False``) with a progress bar, a JSON object per line in
    ``metrics.jsonl``, optional TensorBoard scalars; :meth:`close` saves ``loss.png``.

    Tokens/s is per device (tokens this data-parallel rank processed / wall time / the number of
    ranks that share a sample); MFU is achieved FLOP/s over the device peak (``"n/a"`` when the
    peak is unknown, e.g. on CPUs, unless ``peak_flops`` is configured).

    Args:
        config: The ``[metrics]`` section.
        run_folder: Output folder of the run.
        rank: Global rank.
        total_steps: Steps of the run (for the progress bar).
        num_flops_per_token: Training FLOPs per token of the model.
        non_data_parallel_size: Ranks sharing one sample (``cp * tp * pp``).
        stream: Where console lines go (default ``sys.stdout``).

    Raises:
        ImportError: If TensorBoard is enabled but not installed.

    See Also:
        :titan:`torchtitan.components.metrics.MetricsProcessor`: TorchTitan's metrics.
    """

    def __init__(
        self,
        config: MetricsConfig,
        run_folder: Path,
        rank: int,
        total_steps: int,
        num_flops_per_token: int,
        non_data_parallel_size: int = 1,
        *,
        stream: TextIO | None = None,
    ) -> None:
        self.config = config
        self.run_folder = run_folder
        self.rank = rank
        self.total_steps = total_steps
        self.num_flops_per_token = num_flops_per_token
        self.non_data_parallel_size = non_data_parallel_size
        self.stream = stream if stream is not None else sys.stdout
        self.is_logging_rank = rank == 0 or not config.rank_0_only
        self.history: list[dict[str, Any]] = []
        self.loss_curve: list[tuple[int, float]] = []
        self.validation_curve: list[tuple[int, float]] = []
        self.device_name = _device_name()
        self.peak_flops = config.peak_flops or get_peak_flops(self.device_name)
        self._jsonl: TextIO | None = None
        self._tb: Any = None
        self._wandb: Any = None
        self._closed = False
        self._tokens_since_log = 0
        self._time_last_log = time.perf_counter()
        self._start = self._time_last_log
        self._loss_file: TextIO | None = None
        self._started = False
        if rank == 0 and config.enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError as exc:
                raise ImportError(
                    "metrics.enable_tensorboard needs TensorBoard: "
                    "pip install 'hp-trainer[tensorboard]'"
                ) from exc

    @property
    def jsonl_path(self) -> Path:
        """``metrics.jsonl``: one JSON object per logged step, over every part of the run."""
        return self.run_folder / "metrics.jsonl"

    @property
    def loss_curve_path(self) -> Path:
        """``loss_curve.tsv``: ``step<TAB>loss`` of every step, over every part of the run."""
        return self.run_folder / "loss_curve.tsv"

    def start(self, resume_step: int = 0) -> None:
        """Open the outputs, continuing the history of a run resumed at ``resume_step``.

        A fresh run (``resume_step`` 0) starts new files. A resumed one keeps what the earlier
        part of the run wrote up to and including ``resume_step`` (the checkpoint's step), drops
        the entries after it (they will be computed again, so nothing is duplicated), and
        appends; TensorBoard continues in the same folder with the events after
        ``resume_step`` purged. Called by the first :meth:`log` when not called before.

        Args:
            resume_step: The step the run resumes after (0: a fresh run).

        Raises:
            RuntimeError: If called after logging started.

        See Also:
            :titan:`torchtitan.components.metrics.MetricsProcessor`: TorchTitan's writers.
        """
        if self._started:
            raise RuntimeError("MetricsProcessor.start() called after logging started")
        self._started = True
        if self.rank != 0:
            return
        self.run_folder.mkdir(parents=True, exist_ok=True)
        if resume_step > 0:
            kept = _history_until(self.loss_curve_path, resume_step, _parse_loss_line)
            self.loss_curve = [_parse_loss_line(line) for line in kept] + self.loss_curve
            kept_records = _history_until(
                self.jsonl_path, resume_step, lambda line: (json.loads(line)["step"],)
            )
            validated = [json.loads(line) for line in kept_records]
            self.validation_curve = [
                (r["step"], r["validation_loss"]) for r in validated if "validation_loss" in r
            ] + self.validation_curve
        mode: Literal["a", "w"] = "a" if resume_step > 0 else "w"
        if self.config.enable_jsonl:
            self._jsonl = open(self.jsonl_path, mode)  # noqa: SIM115
        if self.config.enable_plot:
            self._loss_file = open(self.loss_curve_path, mode)  # noqa: SIM115
        if self.config.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = {"purge_step": resume_step + 1} if resume_step > 0 else {}
            self._tb = SummaryWriter(log_dir=str(self.run_folder / "tb"), **purge)
        if self.config.enable_wandb:
            self._wandb = _start_wandb(self.run_folder, resume_step)

    def should_log(self, step: int) -> bool:
        """Whether ``step`` (1-based) is logged.

        Args:
            step: 1-based step.

        Returns:
            True on the first, every ``log_freq``-th and the last step.

        See Also:
            :titan:`torchtitan.components.metrics.MetricsProcessor.should_log`.
        """
        return step == 1 or step % self.config.log_freq == 0 or step == self.total_steps

    def observe_loss(self, step: int, loss: float) -> None:
        """Record the loss of every step for the loss curve (logged or not).

        Args:
            step: 1-based step.
            loss: Global mean loss of the step.

        See Also:
            :titan:`torchtitan.components.metrics.MetricsProcessor.log`.
        """
        if not self._started:
            self.start()
        self.loss_curve.append((step, loss))
        if self._loss_file is not None:
            self._loss_file.write(f"{step}\t{loss!r}\n")
            self._loss_file.flush()

    def add_tokens(self, num_tokens: int) -> None:
        """Count tokens this rank processed since the last log.

        Args:
            num_tokens: Tokens of one micro-batch on this rank.

        See Also:
            :titan:`torchtitan.components.metrics.MetricsProcessor.ntokens_since_last_log`.
        """
        self._tokens_since_log += num_tokens

    def log(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Record one logged step.

        Args:
            step: 1-based step.
            loss: Global mean loss of the step.
            grad_norm: Total gradient norm before clipping.
            lr: Learning rate used.
            extra: More fields for the JSONL record.

        Returns:
            The record written.

        See Also:
            :titan:`torchtitan.components.metrics.MetricsProcessor.log`.
        """
        if not self._started:
            self.start()
        now = time.perf_counter()
        elapsed = max(now - self._time_last_log, 1e-9)
        tps = self._tokens_since_log / elapsed / self.non_data_parallel_size
        flops = tps * self.num_flops_per_token
        mfu = 100.0 * flops / self.peak_flops if self.peak_flops else None
        peak_mem = hp_device.peak_memory_bytes()
        record: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_second": tps,
            "tflops": flops / 1e12,
            "mfu_percent": mfu,
            "peak_memory_gib": peak_mem / 2**30,
            "elapsed_s": now - self._start,
        }
        if extra:
            record.update(extra)
        self.history.append(record)
        if self.rank == 0:
            if self._jsonl is not None:
                self._jsonl.write(json.dumps(record) + "\n")
                self._jsonl.flush()
            if self._tb is not None:
                for key in ("loss", "grad_norm", "lr", "tokens_per_second", "tflops"):
                    self._tb.add_scalar(key, record[key], step)
            if self._wandb is not None:
                numbers = {k: v for k, v in record.items() if isinstance(v, int | float)}
                self._wandb.log({f"train/{k}": v for k, v in numbers.items()}, step=step)
        if self.is_logging_rank:
            mfu_text = f"{mfu:.2f}%" if mfu is not None else "n/a"
            mem_name = "peak_rss" if not hp_device.is_accelerator() else "peak_mem"
            line = (
                f"step {step:5d}  loss {loss:8.4f}  grad_norm {grad_norm:7.4f}  lr {lr:.2e}  "
                f"tps {tps:,.0f}  tflops {flops / 1e12:.3f}  mfu {mfu_text}  "
                f"{mem_name} {peak_mem / 2**30:.2f}GiB"
            ) + format_expert_load(record)
            if self.config.enable_progress_bar:
                line = f"{_bar(step / self.total_steps)} {line}"
            prefix = "" if self.config.rank_0_only else f"[rank{self.rank}] "
            print(prefix + line, file=self.stream, flush=True)
        self._tokens_since_log = 0
        self._time_last_log = time.perf_counter()
        return record

    def log_validation(self, step: int, loss: float, perplexity: float) -> dict[str, Any]:
        """Record a validation result (console, JSONL, TensorBoard, loss plot).

        Args:
            step: The training step it follows.
            loss: Mean validation loss.
            perplexity: ``exp(loss)``.

        Returns:
            The JSONL record ``{"step", "validation_loss", "validation_perplexity"}``.

        See Also:
            :titan:`torchtitan.components.metrics.MetricsProcessor.log_validation`.
        """
        if not self._started:
            self.start()
        record = {"step": step, "validation_loss": loss, "validation_perplexity": perplexity}
        self.history.append(record)
        self.validation_curve.append((step, loss))
        if self.rank == 0:
            if self._jsonl is not None:
                self._jsonl.write(json.dumps(record) + "\n")
                self._jsonl.flush()
            if self._tb is not None:
                self._tb.add_scalar("validation/loss", loss, step)
                self._tb.add_scalar("validation/perplexity", perplexity, step)
            if self._wandb is not None:
                values = {"validation/loss": loss, "validation/perplexity": perplexity}
                self._wandb.log(values, step=step)
        if self.is_logging_rank:
            prefix = "" if self.config.rank_0_only else f"[rank{self.rank}] "
            line = f"validate step {step:5d}  loss {loss:8.4f}  perplexity {perplexity:10.3f}"
            print(prefix + line, file=self.stream, flush=True)
        return record

    def close(self) -> Path | None:
        """Close files and save the loss curve (rank 0).

        Returns:
            The path of ``loss.png`` when written, else None.

        See Also:
            :titan:`torchtitan.components.metrics.MetricsProcessor.close`.
        """
        if self._closed:
            return None
        self._closed = True
        for handle in (self._jsonl, self._loss_file):
            if handle is not None:
                handle.close()
        self._jsonl = self._loss_file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self.rank != 0 or not self.config.enable_plot or not self.loss_curve:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning(
                "loss plot skipped: it needs matplotlib (pip install 'hp-trainer[plot]')"
            )
            return None
        steps = [step for step, _ in self.loss_curve]
        losses = [loss for _, loss in self.loss_curve]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, losses, marker="." if len(steps) < 60 else None, label="training")
        if self.validation_curve:
            ax.plot(*zip(*self.validation_curve, strict=True), marker="o", label="validation")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"{self.run_folder.name}: loss")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = self.run_folder / "loss.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
