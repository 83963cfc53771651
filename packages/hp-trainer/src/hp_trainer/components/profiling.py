"""Profiler traces for a window of steps, and allocator memory snapshots where devices have them."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import torch

from hp_dtensor import device as hp_device
from hp_trainer._torch_compat import memory_snapshot, record_memory_history
from hp_trainer.config import ProfilingConfig

__all__ = ["StepProfiler"]

logger = logging.getLogger("hp_trainer")

MEMORY_SNAPSHOT_UNAVAILABLE = (
    "profiling.enable_memory_snapshot: device type {device!r} has no allocator history "
    "(CUDA only); no memory snapshot is written. Peak memory is still in the step log."
)


class StepProfiler:
    """Torch profiler over a window of steps, and CUDA allocator snapshots, for one rank.

    Every ``profile_freq`` steps the profiler waits, warms up for ``profiler_warmup`` steps and
    traces the last ``profiler_active`` ones; each traced window is written as a Chrome trace
    ``<run>/<save_traces_folder>/iteration_N/rankR_trace.json`` (N: the window's last step,
    open it in ``chrome://tracing`` or Perfetto). With ``enable_memory_snapshot`` on CUDA, the
    allocator history is recorded and dumped every ``profile_freq`` steps and at the end; on
    other devices one note says it is unavailable.

    Args:
        config: The ``[profiling]`` section.
        run_folder: The run's output folder.
        rank: Global rank (in the file names).

    See Also:
        :titan:`torchtitan.tools.profiling.maybe_enable_profiling`: TorchTitan's profiler context;
        :pt:`torch.profiler.profile`: the profiler used.
    """

    def __init__(self, config: ProfilingConfig, run_folder: Path, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.traces_folder = run_folder / config.save_traces_folder
        self.snapshot_folder = run_folder / config.save_memory_snapshot_folder
        self.step_num = 0
        self.traces: list[Path] = []
        self.snapshots: list[Path] = []
        self.note: str | None = None
        self._profiler: Any = None
        self._recording_memory = False
        if config.enable_profiling:
            wait = config.profile_freq - config.profiler_warmup - config.profiler_active
            self._profiler = torch.profiler.profile(
                activities=self._activities(),
                schedule=torch.profiler.schedule(
                    wait=wait, warmup=config.profiler_warmup, active=config.profiler_active
                ),
                on_trace_ready=self._write_trace,
                record_shapes=True,
            )
            self._profiler.start()
        if config.enable_memory_snapshot:
            device = hp_device.get_device_type()
            if device == hp_device.DEVICE_TYPE_CUDA:
                record_memory_history(max_entries=100_000)
                self._recording_memory = True
            else:
                self.note = MEMORY_SNAPSHOT_UNAVAILABLE.format(device=device)
                if rank == 0:
                    logger.warning(self.note)

    @staticmethod
    def _activities() -> list[torch.profiler.ProfilerActivity]:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if hp_device.get_device_type() == hp_device.DEVICE_TYPE_CUDA:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return activities

    def _write_trace(self, profiler: Any) -> None:
        folder = self.traces_folder / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_trace.json"
        profiler.export_chrome_trace(str(path))
        self.traces.append(path)
        if self.rank == 0:
            logger.info("profiler trace of step %d written to %s", self.step_num, path)

    def _dump_memory(self) -> None:
        folder = self.snapshot_folder / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_snapshot.pickle"
        with open(path, "wb") as f:
            pickle.dump(memory_snapshot(), f)
        self.snapshots.append(path)

    def step(self) -> None:
        """Mark the end of a training step.

        See Also:
            :pt:`torch.profiler.profile.step`.
        """
        self.step_num += 1
        if self._profiler is not None:
            self._profiler.step()
        if self._recording_memory and self.step_num % self.config.profile_freq == 0:
            self._dump_memory()

    def close(self) -> None:
        """Stop the profiler and the allocator history (a last snapshot is dumped)."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self._recording_memory:
            self._dump_memory()
            record_memory_history(enabled=None)
            self._recording_memory = False
