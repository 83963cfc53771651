"""The checkpoint manager: periodic crash-safe saves on hp-dcp, exact resume, exports.

Layout on disk: ``<base_folder>/<folder>/step-<N>/`` is one DCP checkpoint (``.metadata``,
``__<rank>_0.distcp`` and hp-dcp's checksum sidecar), committed by a directory rename once
every rank has written, so a ``step-N`` directory is always complete. HuggingFace exports go to
``<base_folder>/<folder>/step-<N>-hf/`` (sharded safetensors, index and ``config.json``).

What a full checkpoint holds (top-level keys of the DCP state dict):

* ``model``: every model part's state dict (any layout: FSDP, HSDP, TP, ... DTensors are
  stored as shards and resharded on load, through hp-dtensor's state-dict helpers);
* ``optimizer``: the optimizers' state, flattened to parameter FQNs;
* ``lr_scheduler``: each scheduler's ``state_dict()``;
* ``dataloader``: the data loader's position (once if it is the same on every rank, per rank
  otherwise);
* ``rng``: per rank, the torch CPU and accelerator generators and Python's ``random``;
* any ``states`` passed by the trainer (its step counter, for instance).

Resume guarantees (tested): in the same layout, a run stopped at step N and resumed has bitwise
the same per-step losses as an uninterrupted run (fp32, deterministic ops); under a different
data-parallel degree (with the same global batch and a loader whose state is a global position)
it sees the same global sample order and matches within ``rtol=1e-5``: the reduction order
changes, so it is not bitwise. Per-rank RNG states are restored for ranks that exist in both
runs; new ranks keep their seeded state and a warning says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.stateful
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import hp_dcp
from hp_dcp.huggingface import parse_size
from hp_dtensor import device as hp_device
from hp_dtensor.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from hp_trainer.components.hf_io.sharded_io import HFShardedReader, HFShardedWriter

__all__ = [
    "CheckpointManager",
    "LRSchedulersState",
    "ModelWrapper",
    "OptimizersWrapper",
    "RNGState",
]

logger = logging.getLogger("hp_trainer.checkpoint")

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
RNG = "rng"
_PER_RANK = "_per_rank"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LOAD_ERRORS = (hp_dcp.CheckpointCorruptionError, hp_dcp.IncompleteCheckpointError)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _world(group) > 1:
        dist.barrier(group=group)


def _broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """``obj`` from the group's first rank, on every rank of the group."""
    if _world(group) == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group we pass ``no_dist=True`` on purpose: drop DCP's warning."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _is_group_leader(group: dist.ProcessGroup | None) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


# --------------------------------------------------------------------------------------------
# Stateful wrappers


class ModelWrapper:
    """The model parts as one ``Stateful``: their state dicts merged by FQN.

    Goes through :func:`hp_dtensor.get_model_state_dict` / :func:`hp_dtensor.set_model_state_dict`,
    so any parameter layout (plain tensors, FSDP/HSDP/TP DTensors) saves as shards and loads
    resharded.

    Args:
        model: One module or a list of model parts (pipeline stages).
        key_filter: Keyword-only; when given, only the keys it accepts are saved and loaded
            (LoRA's adapter-only checkpoints); the other tensors keep their values.

    Raises:
        TypeError: If a part is not an ``nn.Module``.

    See Also:
        :titan:`torchtitan.components.checkpoint.ModelWrapper`: TorchTitan's wrapper.
    """

    def __init__(
        self,
        model: nn.Module | Iterable[nn.Module],
        *,
        key_filter: Callable[[str], bool] | None = None,
    ) -> None:
        parts = [model] if isinstance(model, nn.Module) else list(model)
        for part in parts:
            if not isinstance(part, nn.Module):
                raise TypeError(f"model parts must be nn.Modules, got {type(part).__name__}")
        self.model_parts = parts
        self.key_filter = key_filter

    def state_dict(self) -> dict[str, Any]:
        """Return the merged model state dict (DTensors stay sharded).

        Returns:
            FQN -> tensor for every part.

        See Also:
            :pt:`torch.distributed.checkpoint.state_dict.get_model_state_dict`.
        """
        out: dict[str, Any] = {}
        for part in self.model_parts:
            out.update(get_model_state_dict(part))
        if self.key_filter is not None:
            out = {k: v for k, v in out.items() if self.key_filter(k)}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the merged state dict into every part (each takes its own keys).

        Args:
            state_dict: FQN -> tensor (sharded or full).

        Raises:
            RuntimeError: If a part's key is missing (with one part, also an unexpected key).

        See Also:
            :pt:`torch.distributed.checkpoint.state_dict.set_model_state_dict`.
        """
        keep = self.key_filter
        strict = len(self.model_parts) == 1 and keep is None
        for part in self.model_parts:
            own = {k: v for k, v in state_dict.items() if strict or k in _part_keys(part)}
            result = set_model_state_dict(part, own, options=StateDictOptions(strict=strict))
            missing = [k for k in result.missing_keys if keep is None or keep(k)]
            if not strict and missing:
                raise RuntimeError(f"checkpoint lacks model keys {sorted(missing)}")


def _part_keys(part: nn.Module) -> set[str]:
    return set(get_model_state_dict(part).keys())


class OptimizersWrapper:
    """Optimizers (one per model part) as one ``Stateful``, flattened to parameter FQNs.

    Flattened keys (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``) do not depend on the
    parameter order or on how the model is split, so a checkpoint loads into any layout and any
    pipeline split; sharded state stays DTensors.

    Args:
        model_parts: The model parts.
        optimizers: One optimizer, a list, or a container iterating over one per part.

    Raises:
        ValueError: If the numbers of parts and optimizers differ.

    See Also:
        :titan:`torchtitan.components.optimizer.OptimizersContainer.state_dict`.
    """

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(
        self,
        model_parts: nn.Module | Iterable[nn.Module],
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    ) -> None:
        parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
        opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        if len(parts) != len(opts):
            raise ValueError(
                f"got {len(parts)} model parts and {len(opts)} optimizers; expected one "
                "optimizer per model part"
            )
        self.model_parts = parts
        self.optimizers = opts

    def state_dict(self) -> dict[str, Any]:
        """Return the flattened state of every optimizer.

        Returns:
            Flat key -> value.

        See Also:
            :pt:`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`.
        """
        out: dict[str, Any] = {}
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            out.update(get_optimizer_state_dict(part, opt, options=self._OPTIONS))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the flattened state into every optimizer.

        Args:
            state_dict: Flat key -> value, as from :meth:`state_dict`.

        See Also:
            :pt:`torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`.
        """
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            set_optimizer_state_dict(part, opt, state_dict, options=self._OPTIONS)


class LRSchedulersState:
    """Learning-rate schedulers as one ``Stateful``: ``{"0": sched0.state_dict(), ...}``.

    Accepts one ``torch.optim.lr_scheduler.LRScheduler``, a list of them, or a container with a
    ``schedulers`` list (hp-trainer's and TorchTitan's ``LRSchedulersContainer``).

    Args:
        schedulers: The scheduler(s).

    Raises:
        TypeError: If no scheduler with ``state_dict``/``load_state_dict`` is found.

    See Also:
        :titan:`torchtitan.components.lr_scheduler.LRSchedulersContainer.state_dict`.
    """

    def __init__(self, schedulers: Any) -> None:
        items = getattr(schedulers, "schedulers", schedulers)
        scheds = [items] if hasattr(items, "load_state_dict") else list(items)
        for s in scheds:
            if not (hasattr(s, "state_dict") and hasattr(s, "load_state_dict")):
                raise TypeError(
                    f"lr_schedulers must be LRSchedulers or a container of them, got "
                    f"{type(s).__name__} without state_dict/load_state_dict"
                )
        self.schedulers = scheds

    def state_dict(self) -> dict[str, Any]:
        """Return every scheduler's state (step counter, last learning rates, ...).

        Returns:
            ``{"<index>": state}``.

        See Also:
            :pt:`torch.optim.lr_scheduler.LRScheduler.state_dict`.
        """
        return {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every scheduler.

        Args:
            state_dict: As from :meth:`state_dict`.

        Raises:
            ValueError: If the number of schedulers differs from the checkpoint's.

        See Also:
            :pt:`torch.optim.lr_scheduler.LRScheduler.load_state_dict`.
        """
        if len(state_dict) != len(self.schedulers):
            raise ValueError(
                f"the checkpoint holds {len(state_dict)} LR schedulers, this run has "
                f"{len(self.schedulers)}"
            )
        for i, s in enumerate(self.schedulers):
            s.load_state_dict(dict(state_dict[str(i)]))


def _python_rng_to_tensor() -> torch.Tensor:
    version, internal, gauss = random.getstate()
    values = [int(version), *internal, 0 if gauss is None else 1]
    out = torch.tensor(values, dtype=torch.int64)
    bits = torch.tensor([0.0 if gauss is None else float(gauss)], dtype=torch.float64)
    return torch.cat([out, bits.view(torch.int64)])


def _python_rng_from_tensor(t: torch.Tensor) -> None:
    values = t.tolist()
    gauss_bits = t[-1:].view(torch.float64).item()
    has_gauss = values[-2]
    random.setstate((values[0], tuple(values[1:-2]), gauss_bits if has_gauss else None))


class RNGState:
    """This rank's random generators as a ``Stateful``: torch CPU, accelerator, ``random``.

    The state dict is keyed by the global rank (``{"rank_3": {...}}``), so every rank saves its
    own generators and a checkpoint holds all of them; on load each rank restores its own.

    See Also:
        :pt:`torch.random.get_rng_state`: PyTorch's CPU generator state.
    """

    def key(self) -> str:
        """Return this rank's key in the state dict (``rank_<global rank>``).

        Returns:
            The key.

        See Also:
            :pt:`torch.distributed.get_rank`.
        """
        return f"rank_{_rank()}"

    def state_dict(self) -> dict[str, Any]:
        """Capture this rank's generators.

        Returns:
            ``{"rank_<r>": {"torch_cpu": ..., "python": ..., "device": ...}}`` (``device``
            only on accelerators).

        See Also:
            :pt:`torch.random.get_rng_state`.
        """
        state: dict[str, torch.Tensor] = {
            "torch_cpu": torch.get_rng_state(),
            "python": _python_rng_to_tensor(),
        }
        dev = hp_device.get_device_type()
        if hp_device.is_accelerator(dev):
            state["device"] = torch.get_device_module(dev).get_rng_state()
        return {self.key(): state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's generators from its entry.

        Args:
            state_dict: As from :meth:`state_dict` (only this rank's key is used).

        Raises:
            KeyError: If this rank's entry is missing.

        See Also:
            :pt:`torch.random.set_rng_state`.
        """
        state = state_dict[self.key()]
        torch.set_rng_state(state["torch_cpu"])
        _python_rng_from_tensor(state["python"])
        if "device" in state:
            dev = hp_device.get_device_type()
            torch.get_device_module(dev).set_rng_state(state["device"])


# --------------------------------------------------------------------------------------------
# the manager


@dataclass(frozen=True)
class _Options:
    enable: bool
    folder: str
    interval: int
    keep_latest_k: int
    async_mode: str
    load_step: int
    initial_load_path: str | None
    initial_load_model_only: bool
    initial_load_in_hf: bool
    last_save_model_only: bool
    last_save_in_hf: bool
    export_dtype: str
    hf_max_shard_size: str
    exclude_from_loading: tuple[str, ...]
    enable_first_step_checkpoint: bool


_DEFAULTS: dict[str, Any] = {
    "enable": False,
    "folder": "checkpoint",
    "interval": 500,
    "keep_latest_k": 10,
    "async_mode": "disabled",
    "load_step": -1,
    "initial_load_path": None,
    "initial_load_model_only": True,
    "initial_load_in_hf": False,
    "last_save_model_only": True,
    "last_save_in_hf": False,
    "export_dtype": "float32",
    "hf_max_shard_size": "5GB",
    "exclude_from_loading": (),
    "enable_first_step_checkpoint": False,
}


def _options(config: Any) -> _Options:
    values = {k: getattr(config, k, d) for k, d in _DEFAULTS.items()}
    if isinstance(values["exclude_from_loading"], str):
        values["exclude_from_loading"] = tuple(
            s.strip() for s in values["exclude_from_loading"].split(",") if s.strip()
        )
    values["exclude_from_loading"] = tuple(values["exclude_from_loading"] or ())
    if values["initial_load_path"] == "":
        values["initial_load_path"] = None

    def bad(name: str, allowed: str) -> ValueError:
        return ValueError(f"checkpoint.{name} = {values[name]!r}: expected {allowed}")

    if not isinstance(values["interval"], int) or values["interval"] < 1:
        raise bad("interval", "an integer >= 1")
    if not isinstance(values["keep_latest_k"], int) or values["keep_latest_k"] < 0:
        raise bad("keep_latest_k", "an integer >= 0 (0 keeps every checkpoint)")
    if values["async_mode"] not in _ASYNC_MODES:
        raise bad("async_mode", "one of " + ", ".join(_ASYNC_MODES))
    if values["export_dtype"] not in _EXPORT_DTYPES:
        raise bad("export_dtype", "one of " + ", ".join(_EXPORT_DTYPES))
    if not isinstance(values["load_step"], int) or values["load_step"] < -1:
        raise bad("load_step", "-1 (the latest) or a step >= 0")
    try:
        parse_size(values["hf_max_shard_size"])
    except ValueError:
        raise bad("hf_max_shard_size", "a size like '5GB', '500MiB' or bytes") from None
    if values["async_mode"] == "async_with_pinned_mem" and not hp_device.pin_memory_available():
        raise ValueError(
            "checkpoint.async_mode = 'async_with_pinned_mem' needs pinned host memory, which "
            f"device type {hp_device.get_device_type()!r} does not have; use 'async'"
        )
    return _Options(**values)


def _flat_keys(path: Path) -> set[str]:
    md = hp_dcp.FileSystemReader(path).read_metadata()
    return set(md.state_dict_metadata.keys())


def _has_prefix(keys: set[str], prefix: str) -> bool:
    dotted = prefix + "."
    return any(k == prefix or k.startswith(dotted) for k in keys)


class CheckpointManager:
    """Save every ``interval`` steps, keep the latest ``keep_latest_k``, resume exactly.

    Built on hp-dcp (crash-safe commits, checksums verified on load, resharding): model and
    optimizer state go through hp-dtensor's state-dict helpers, so a checkpoint saved in one
    layout and world size loads into another. Resuming (:meth:`load`) picks the latest complete
    ``step-N``; if it fails its checksums or is incomplete, the error (naming the file) is logged
    and the previous checkpoint is used. Asynchronous saves (``async_mode="async"``) stage to host
    memory and write in a background thread over a dedicated gloo process group.

    Options are read from ``checkpoint_config`` by TorchTitan's field names; a field the config
    does not have takes TorchTitan's default: ``enable`` (False), ``folder`` ("checkpoint"),
    ``interval`` (500), ``keep_latest_k`` (10; 0 keeps all; 1 is safe here because a save
    commits before the purge), ``async_mode`` ("disabled" | "async" | "async_with_pinned_mem"),
    ``load_step`` (-1), ``initial_load_path`` (None), ``initial_load_model_only`` (True),
    ``initial_load_in_hf`` (False), ``last_save_model_only`` (True), ``last_save_in_hf`` (False),
    ``export_dtype`` ("float32"), ``hf_max_shard_size`` ("5GB"), ``exclude_from_loading`` (()),
    ``enable_first_step_checkpoint`` (False).

    Args:
        dataloader: The data loader (``Stateful``) or ``None``.
        model_parts: The model parts (a module or a list).
        optimizers: The optimizers (one per part; a container iterating over them is fine).
        lr_schedulers: A scheduler, a list, a container with ``schedulers``, or ``None``.
        states: Further ``Stateful`` objects by key (the trainer's step counter, ...).
        checkpoint_config: The ``[checkpoint]`` section (see above).
        sd_adapter: The model's HuggingFace state-dict adapter (needed for HF import/export).
        base_folder: The run folder; checkpoints go to ``<base_folder>/<folder>``.
        process_group: Keyword-only; the group taking part in saves and loads (default world).
        model_key_filter: Keyword-only; the model keys checkpoints hold (None: all). LoRA's
            adapter-only checkpoints: the other keys come from ``initial_load_path``, which
            is loaded again (without them) before a step checkpoint on resume.
        hf_export_transform: Keyword-only; ``fn(full_state, path) -> state`` applied on the
            first rank to the gathered model before the HF export (LoRA merges its adapters).
        preload_states: Keyword-only; keys of ``states`` loaded (and checked by their
            ``load_state_dict``) before anything else, and saved with model-only checkpoints.

    Raises:
        ValueError: For invalid options, or a key of ``states`` that collides with a built-in.

    See Also:
        :titan:`torchtitan.components.checkpoint.CheckpointManager`: TorchTitan's manager.
    """

    def __init__(
        self,
        dataloader: torch.distributed.checkpoint.stateful.Stateful | None,
        model_parts: nn.Module | list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: Mapping[str, torch.distributed.checkpoint.stateful.Stateful],
        checkpoint_config: Any,
        sd_adapter: Any = None,
        base_folder: str | Path = "",
        *,
        process_group: dist.ProcessGroup | None = None,
        model_key_filter: Callable[[str], bool] | None = None,
        hf_export_transform: Callable[[dict[str, torch.Tensor], Path], dict[str, torch.Tensor]]
        | None = None,
        preload_states: Iterable[str] = (),
    ) -> None:
        self.options = _options(checkpoint_config)
        self.enable = self.options.enable
        self.folder = Path(base_folder) / self.options.folder
        self.interval = self.options.interval
        self.keep_latest_k = self.options.keep_latest_k
        self.sd_adapter = sd_adapter
        self.process_group = process_group
        self.model = ModelWrapper(model_parts, key_filter=model_key_filter)
        self.hf_export_transform = hf_export_transform
        # small states checked before the model is read (LoRA's rank/alpha), saved with the
        # model-only checkpoints too
        self.preload_states = tuple(preload_states)
        self.states: dict[str, Any] = {MODEL: self.model}
        if optimizers is not None:
            self.states[OPTIMIZER] = OptimizersWrapper(self.model.model_parts, optimizers)
        if lr_schedulers is not None:
            self.states[LR_SCHEDULER] = LRSchedulersState(lr_schedulers)
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        self.states[RNG] = RNGState()
        for key, value in states.items():
            if key in self.states:
                raise ValueError(f"states key {key!r} collides with a built-in checkpoint key")
            if not (hasattr(value, "state_dict") and hasattr(value, "load_state_dict")):
                raise TypeError(f"states[{key!r}] is not Stateful (state_dict/load_state_dict)")
            self.states[key] = value
        self._pending: Future[Any] | None = None
        self._staging: Future[Any] | None = None
        self._async_group: dist.ProcessGroup | None = None
        if self.enable and self.options.async_mode != "disabled" and _world() > 1:
            # background saves must not interleave their collectives with training's
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            self._async_group = dist.new_group(ranks=ranks, backend=hp_device.BACKEND_GLOO)
        self._stager: DefaultStager | None = None
        if self.enable and self.options.async_mode == "async_with_pinned_mem":
            # copies into reusable pinned host buffers in the background (accelerators only)
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=True,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=True,
                )
            )
        self.loaded_step: int | None = None
        self.skipped: list[tuple[int, str]] = []
        """(step, error) of the checkpoints passed over by the last :meth:`load`."""

    # -- paths -------------------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        """Return the directory of the checkpoint of ``step``.

        Args:
            step: The training step.

        Returns:
            ``<folder>/step-<step>``.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager._create_checkpoint_id`.
        """
        return self.folder / f"step-{step}"

    def list_steps(self) -> list[int]:
        """Return the steps of the complete checkpoints in the folder, ascending.

        A directory counts when it is named ``step-N`` and holds ``.metadata`` (hp-dcp commits
        by renaming a finished directory, so a partial save never has that name).

        Returns:
            The steps.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager._find_load_step`.
        """
        if not self.folder.is_dir():
            return []
        steps = []
        for entry in self.folder.iterdir():
            m = _STEP_DIR.match(entry.name)
            if m and entry.is_dir() and (entry / ".metadata").is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    # -- save ----------------------------------------------------------------------------------

    def _dcp_save(self, state: dict[str, Any], path: Path) -> None:
        with _single_process_quiet():
            hp_dcp.save(
                state,
                checkpoint_id=path,
                process_group=self.process_group,
                no_dist=not dist.is_initialized(),
            )

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if not self.enable:
            return False
        if curr_step == 1 and self.options.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def is_due(self, curr_step: int, last_step: bool = False) -> bool:
        """Whether :meth:`save` would save at ``curr_step`` (without ``force``).

        Args:
            curr_step: The step just completed.
            last_step: Whether it is the last step of the run.

        Returns:
            True on a checkpoint step when checkpointing is enabled.
        """
        return self._should_save(curr_step, last_step)

    def _full_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, obj in self.states.items():
            if key == DATALOADER:
                out[key] = self._dataloader_state(obj.state_dict())
            else:
                out[key] = obj.state_dict()
        return out

    def _dataloader_state(self, state: Any) -> Any:
        """The loader's state once if every rank has the same, else per rank (never lost)."""
        group = self.process_group
        if _world(group) == 1:
            return state
        try:
            mine = pickle.dumps(state)
        except Exception:
            mine = None
        gathered: list[Any] = [None] * _world(group)
        dist.all_gather_object(gathered, mine, group=group)
        if mine is not None and all(g == mine for g in gathered):
            return state
        return {_PER_RANK: {str(_rank()): state}}

    def _model_state(self, dtype: torch.dtype | None) -> dict[str, Any]:
        sd = self.model.state_dict()
        if dtype is not None:
            sd = {
                k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in sd.items()
            }
        return {MODEL: sd, **{k: self.states[k].state_dict() for k in self.preload_states}}

    def save(self, curr_step: int, last_step: bool = False, *, force: bool = False) -> bool:
        """Save a checkpoint if ``curr_step`` is due (every ``interval`` steps, or the last).

        The last step's save is model-only in ``export_dtype`` when ``last_save_model_only`` is
        set, and also exported as HuggingFace safetensors when ``last_save_in_hf`` is. Older
        checkpoints beyond ``keep_latest_k`` are removed once the new one committed.

        Args:
            curr_step: The step just completed.
            last_step: Whether it is the last step of the run (always saved).
            force: Keyword-only; save a full, synchronous checkpoint now whatever the interval
                (a run stopped by SIGTERM, for instance). Ignored when checkpointing is off.

        Returns:
            Whether a checkpoint was saved (or, asynchronously, started).

        Raises:
            ValueError: ``last_save_in_hf`` without a state-dict adapter.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager.save`.
        """
        if not (self._should_save(curr_step, last_step) or (force and self.enable)):
            return False
        self.wait()
        path = self.step_dir(curr_step)
        if last_step and self.options.last_save_model_only:
            dtype = _EXPORT_DTYPES[self.options.export_dtype]
            self._dcp_save(self._model_state(dtype), path)
            if self.options.last_save_in_hf:
                self.export_hf(self.folder / f"step-{curr_step}-hf", dtype=dtype)
            self._purge()
            return True
        state = self._full_state()
        if self.options.async_mode == "disabled" or last_step or force:
            self._dcp_save(state, path)
            self._purge()
        else:
            with _single_process_quiet():
                result = hp_dcp.async_save(
                    state,
                    checkpoint_id=path,
                    process_group=self._async_group or self.process_group,
                    async_stager=self._stager,
                    no_dist=not dist.is_initialized(),
                )
            if isinstance(result, AsyncSaveResponse):  # a stager that stages in the background
                self._staging = result.staging_completion
                self._pending = result.upload_completion
            else:
                self._pending = result
        if last_step and self.options.last_save_in_hf:
            self.export_hf(self.folder / f"step-{curr_step}-hf")
        return True

    def maybe_wait_for_staging(self) -> None:
        """Block until the pending asynchronous save no longer reads the training tensors.

        Call it before the optimizer step that follows an asynchronous :meth:`save`. hp-dcp's
        default writer stages (copies to host memory) before :meth:`save` returns, so then
        there is nothing to wait for; a background stager is waited on here.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager.maybe_wait_for_staging`.
        """
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.result()

    def wait(self) -> None:
        """Block until the pending asynchronous save committed, then purge old checkpoints.

        Raises:
            Exception: Whatever the background save raised.

        See Also:
            :pt:`torch.distributed.checkpoint.async_save`: returns the future waited on.
        """
        if self._pending is None:
            return
        self.maybe_wait_for_staging()
        future, self._pending = self._pending, None
        future.result()
        self._purge()

    def _purge(self) -> None:
        if self.keep_latest_k > 0 and _is_group_leader(self.process_group):
            steps = [s for s in self.list_steps() if s != 0]  # the seed checkpoint stays
            for step in steps[: -self.keep_latest_k]:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)
        _barrier(self.process_group)

    def create_seed_checkpoint(self) -> Path:
        """Save the freshly initialized model as ``step-0`` (model only), for identical init.

        Every later run that finds no newer checkpoint loads ``step-0``'s weights, whatever its
        layout, so runs under different parallelisms start from the same parameters.

        Returns:
            The checkpoint directory.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager` with
            ``create_seed_checkpoint``: TorchTitan's seed checkpoint.
        """
        path = self.step_dir(0)
        self._dcp_save(self._model_state(None), path)
        return path

    # -- export ------------------------------------------------------------------------------

    def _full_model_state(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Full (unsharded) model tensors on rank 0, empty elsewhere (a collective)."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        out: dict[str, torch.Tensor] = {}
        for part in self.model.model_parts:
            out.update(get_model_state_dict(part, options=opts))
        if dtype is not None:
            out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
        return out

    def export_model(self, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Save the model alone as a DCP checkpoint (weights for inference or fine-tuning).

        Args:
            path: The checkpoint directory.
            dtype: Cast floating-point tensors to this dtype (``torch.bfloat16`` halves it).

        Returns:
            ``path`` as a ``Path``.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager` with
            ``last_save_model_only`` and ``export_dtype``.
        """
        self._dcp_save(self._model_state(dtype), Path(path))
        return Path(path)

    def export_hf(self, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Write the model as a HuggingFace checkpoint: safetensors shards, index, config.json.

        A collective every rank joins. With an adapter that maps tensors one by one
        (``hf_source``), the ``model-0000i-of-0000N.safetensors`` files (at most
        ``hf_max_shard_size`` bytes each) are spread over the ranks holding their tensors and
        each writer assembles its files one tensor at a time
        (:class:`~hp_trainer.components.hf_io.sharded_io.HFShardedWriter`); otherwise full
        tensors are gathered on
        rank 0 and written there.

        Args:
            path: The output directory.
            dtype: Cast floating-point tensors to this dtype.

        Returns:
            ``path`` as a ``Path``.

        Raises:
            ValueError: If the manager has no ``sd_adapter``.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager` with ``last_save_in_hf``.
        """
        if self.sd_adapter is None:
            raise ValueError(
                "HuggingFace export needs the model's state-dict adapter: pass sd_adapter "
                "(e.g. hp_trainer.components.hf_io.adapters.Llama3StateDictAdapter(model_args))"
            )
        out = Path(path)
        if self.hf_export_transform is not None:  # e.g. LoRA: merge on rank 0, then write
            full = self._full_model_state(dtype)
            if _is_group_leader(self.process_group):
                merged = self.hf_export_transform(full, out)
                hp_dcp.save_hf_safetensors(
                    self.sd_adapter.to_hf(merged),
                    out,
                    max_shard_size=self.options.hf_max_shard_size,
                )
        elif hasattr(self.sd_adapter, "hf_source"):  # per-tensor adapter: no rank-0 gather
            HFShardedWriter(
                self.sd_adapter,
                self.process_group,
                max_shard_size=self.options.hf_max_shard_size,
            ).save(self.model.model_parts, out, dtype=dtype)
        else:
            full = self._full_model_state(dtype)
            if _is_group_leader(self.process_group):
                hp_dcp.save_hf_safetensors(
                    self.sd_adapter.to_hf(full), out, max_shard_size=self.options.hf_max_shard_size
                )
        if _is_group_leader(self.process_group) and hasattr(self.sd_adapter, "hf_config"):
            config = self.sd_adapter.hf_config()
            if dtype is not None:
                config["torch_dtype"] = str(dtype).removeprefix("torch.")
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _barrier(self.process_group)
        return out

    def load_hf(self, path: str | Path) -> None:
        """Load the model's weights from a HuggingFace safetensors checkpoint.

        With an adapter that maps tensors one by one (``hf_source``), each rank reads only the
        slices its shards hold
        (:class:`~hp_trainer.components.hf_io.sharded_io.HFShardedReader`); otherwise
        every rank reads the files and keeps the shards of its layout.

        Args:
            path: The HuggingFace checkpoint directory.

        Raises:
            ValueError: If the manager has no ``sd_adapter``.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager` with
            ``initial_load_in_hf``.
        """
        if self.sd_adapter is None:
            raise ValueError(
                "HuggingFace import needs the model's state-dict adapter: pass sd_adapter"
            )
        keep = self.model.key_filter  # the keys checkpoints hold: not in an HF base model
        skip = None if keep is None else keep
        if hasattr(self.sd_adapter, "hf_source"):  # each rank reads only its own slices
            HFShardedReader(self.sd_adapter, self.process_group).load(
                self.model.model_parts, path, skip=skip
            )
            return
        sd = self.sd_adapter.from_hf(hp_dcp.load_hf_safetensors(path))
        strict = len(self.model.model_parts) == 1 and skip is None
        opts = StateDictOptions(full_state_dict=True, strict=strict)
        for part in self.model.model_parts:
            keys = _part_keys(part)
            set_model_state_dict(part, {k: v for k, v in sd.items() if k in keys}, options=opts)

    # -- load ----------------------------------------------------------------------------------

    def load(self, step: int = -1) -> bool:
        """Resume: load ``step``, or the latest complete checkpoint, or the initial one.

        With ``step=-1`` (and no ``load_step`` option) the newest ``step-N`` is loaded; if it
        fails its checksums or is incomplete, the error is logged (naming the file) and the
        next older one is tried (:attr:`skipped` records them). A model-only checkpoint
        (``step-0`` seed, exports) restores the model alone, with a warning when it is not the
        seed. With no checkpoint in the folder, ``initial_load_path`` is loaded when set
        (model only per ``initial_load_model_only``; HuggingFace per ``initial_load_in_hf``).

        Args:
            step: The step to load (-1: the latest).

        Returns:
            Whether anything was loaded.

        Raises:
            FileNotFoundError: A requested step does not exist.
            hp_dcp.CheckpointCorruptionError: The requested step (or, for ``-1``, every
                checkpoint) is corrupted.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager.load`.
        """
        if not self.enable:
            return False
        self.wait()
        self.skipped = []
        if step == -1 and self.options.load_step != -1:
            step = self.options.load_step
        steps: list[int] = _broadcast(self.list_steps(), self.process_group)
        if steps and self.model.key_filter is not None and self.options.initial_load_path:
            # adapter-only checkpoints: the frozen base comes from the initial checkpoint again
            self._load_initial(self.options.initial_load_path)
        if step != -1:
            if step not in steps:
                raise FileNotFoundError(
                    f"no complete checkpoint for step {step} in {self.folder}; found {steps}"
                )
            self._load_dir(self.step_dir(step), model_only=step == 0)
            self.loaded_step = step
            return True
        for candidate in reversed(steps):
            try:
                self._load_dir(self.step_dir(candidate), model_only=candidate == 0)
            except _LOAD_ERRORS as exc:
                if _is_group_leader(
                    self.process_group
                ):  # every rank gets the same error (hp-dcp gathers them)
                    logger.warning(
                        "checkpoint %s is unusable (%s); falling back to the previous one",
                        self.step_dir(candidate),
                        exc,
                    )
                self.skipped.append((candidate, str(exc)))
                continue
            self.loaded_step = candidate
            return True
        if self.skipped:
            raise hp_dcp.CheckpointCorruptionError(
                f"no usable checkpoint in {self.folder}: "
                + "; ".join(f"step-{s}: {e}" for s, e in self.skipped)
            )
        initial = self.options.initial_load_path
        if initial is None:
            return False
        self._load_initial(initial)
        self.loaded_step = 0
        return True

    def _load_initial(self, initial: str) -> None:
        keep = self.model.key_filter
        if keep is None:
            self._load_initial_model(initial)
            return
        # checkpoints hold the keys ``keep`` accepts (LoRA adapters): the initial one the rest
        self.states[MODEL] = ModelWrapper(self.model.model_parts, key_filter=lambda k: not keep(k))
        try:
            self._load_initial_model(initial)
        finally:
            self.states[MODEL] = self.model

    def _load_initial_model(self, initial: str) -> None:
        if self.options.initial_load_in_hf:
            if not self.options.initial_load_model_only:
                raise ValueError(
                    "checkpoint.initial_load_in_hf = true needs initial_load_model_only = true: "
                    "a HuggingFace checkpoint holds weights only"
                )
            self.load_hf(initial)
        else:
            self._load_dir(Path(initial), model_only=self.options.initial_load_model_only)

    def _load_dir(self, path: Path, *, model_only: bool) -> None:
        keys = _flat_keys(path)
        first = {
            k: self.states[k].state_dict()
            for k in self.preload_states
            if _has_prefix(keys, k) and k not in self.options.exclude_from_loading
        }
        if first:  # a mismatch is reported before any tensor of another shape is read
            with _single_process_quiet():
                hp_dcp.load(
                    first,
                    checkpoint_id=path,
                    process_group=self.process_group,
                    no_dist=not dist.is_initialized(),
                )
            for key, value in first.items():
                self.states[key].load_state_dict(value)
        wanted = [MODEL] if model_only else list(self.states)
        wanted = [k for k in wanted if k not in self.options.exclude_from_loading]
        missing = [k for k in wanted if not _has_prefix(keys, k)]
        if MODEL in missing:
            raise hp_dcp.IncompleteCheckpointError(f"checkpoint {path} holds no model state")
        if missing and not model_only:
            only_model = not any(_has_prefix(keys, k) for k in self.states if k != MODEL)
            if only_model:
                logger.warning(
                    "checkpoint %s holds the model only: %s start fresh", path, ", ".join(missing)
                )
            else:
                raise ValueError(
                    f"checkpoint {path} lacks the states {missing}; list them in "
                    "checkpoint.exclude_from_loading to start them fresh"
                )
        wanted = [k for k in wanted if k not in missing and k not in first]
        to_load: dict[str, Any] = {}
        rng_key = None
        for key in wanted:
            obj = self.states[key]
            if key == RNG:
                rng_key = obj.key()
                if not _has_prefix(keys, f"{RNG}.{rng_key}"):
                    logger.warning(
                        "checkpoint %s has no RNG state for %s (saved at another world size); "
                        "its generators keep their current state",
                        path,
                        rng_key,
                    )
                    continue
                to_load[key] = obj.state_dict()
            elif key == DATALOADER:
                to_load[key] = self._dataloader_template(obj, keys, path)
            else:
                to_load[key] = obj.state_dict()
        with _single_process_quiet():
            hp_dcp.load(
                to_load,
                checkpoint_id=path,
                process_group=self.process_group,
                no_dist=not dist.is_initialized(),
            )
        for key, value in to_load.items():
            if key == DATALOADER and isinstance(value, dict) and _PER_RANK in value:
                value = value[_PER_RANK][str(_rank())]
            self.states[key].load_state_dict(value)

    def _dataloader_template(self, loader: Any, keys: set[str], path: Path) -> Any:
        state = loader.state_dict()
        if not _has_prefix(keys, f"{DATALOADER}.{_PER_RANK}"):
            return state
        if not _has_prefix(keys, f"{DATALOADER}.{_PER_RANK}.{_rank()}"):
            raise ValueError(
                f"checkpoint {path} holds a per-rank data loader state (the ranks' states "
                f"differed when saving) but none for rank {_rank()}: resume at the world size "
                "it was saved with, or use a loader whose state is the same on every rank"
            )
        return {_PER_RANK: {str(_rank()): state}}

    def close(self) -> None:
        """Wait for a pending save and release the background process group.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager.close`.
        """
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None
