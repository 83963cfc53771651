"""The training loop: build everything from a :class:`~hp_trainer.config.JobConfig` and train."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hp_dtensor import device as hp_device
from hp_trainer._parallel_api import loss_parallel
from hp_trainer._torch_compat import foreach_mul_
from hp_trainer.callbacks import (
    CallbackList,
    MetricsCallback,
    ProfilerCallback,
    load_callback_class,
)
from hp_trainer.components.checkpoint import CheckpointManager
from hp_trainer.components.converters import build_model_converters
from hp_trainer.components.data.dataset import (
    ParallelAwareDataloader,
    TokenizedDataset,
    load_documents,
)
from hp_trainer.components.data.prepared import PreparedTokenDataset, is_prepared_corpus
from hp_trainer.components.data.streaming import StreamingTextLoader
from hp_trainer.components.expert_load import ExpertLoadTracker
from hp_trainer.components.hf_io.config import resolve_model_args
from hp_trainer.components.loss import IGNORE_INDEX, summed_token_loss
from hp_trainer.components.lr import build_lr_schedulers
from hp_trainer.components.metrics import MetricsProcessor, logger
from hp_trainer.components.optimizer import build_optimizers
from hp_trainer.components.profiling import StepProfiler
from hp_trainer.components.tokenizer import HuggingFaceTokenizer, build_tokenizer
from hp_trainer.components.validation import Validator
from hp_trainer.config import JobConfig
from hp_trainer.distributed.context_parallel import ContextParallelStep
from hp_trainer.distributed.layout_validation import validate_parallel_layout
from hp_trainer.distributed.offload import offload_optimizers
from hp_trainer.distributed.parallel_dims import parallel_dims_from_config
from hp_trainer.distributed.param_offload import ParamOffloader, offload_params
from hp_trainer.distributed.pipeline import PipelinedStep
from hp_trainer.models.common.document_mask import DocumentBoundaries
from hp_trainer.protocols.model_spec import ModelSpec, get_model_spec

__all__ = ["BaseTrainer", "LLMTrainer", "Trainer", "clip_grad_norm_"]


def clip_grad_norm_(
    parameters: list[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip gradients by their total norm; works for plain tensors and DTensors alike.

    The norm of DTensor gradients (sharded by FSDP and/or TP) is reduced over their mesh, so
    every rank sees the global norm and scales by the same factor.

    Args:
        parameters: Parameters whose ``.grad`` is clipped.
        max_norm: Maximum total norm (<= 0: compute the norm only).
        norm_type: p of the p-norm.
        error_if_nonfinite: Raise on a NaN/inf norm.
        foreach: Use multi-tensor kernels (None: torch's choice).
        pp_mesh: The pipeline mesh when each rank holds only some stages: the stages' norms
            are combined over it (TorchTitan's argument).

    Returns:
        The total norm before clipping (a plain scalar tensor).

    See Also:
        :pt:`torch.nn.utils.clip_grad_norm_`: PyTorch's clipping;
        :titan:`torchtitan.distributed.utils.clip_grad_norm_`: TorchTitan's DTensor-aware one.
    """
    # DTensor gradients on different meshes (experts on the expert mesh under EP) are normed
    # per mesh, then combined: the p-norm of the per-mesh p-norms is the total p-norm
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param)
    norms = []
    for group in by_mesh.values():
        group_grads = [p.grad for p in group if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(group_grads, norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        total = norms[0]
    else:
        total = torch.nn.utils.get_total_norm(norms, norm_type, error_if_nonfinite, foreach)
    if pp_mesh is not None and pp_mesh.size() > 1:
        # each pipeline rank holds other stages' parameters: combine the per-stage norms
        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            total = total**norm_type
            dist.all_reduce(total, group=pp_mesh.get_group())
            total = total ** (1.0 / norm_type)
    if max_norm > 0:
        _scale_local_grads_(parameters, max_norm, total, foreach)
    return total


@torch.no_grad()
def _scale_local_grads_(
    parameters: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor, foreach: bool | None
) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` (its factor and kernels) on the gradients'
    local tensors: one factor multiplies every shard, replica or partial sum alike, so the
    result is the DTensor op's, without dispatching a DTensor ``_foreach_mul_`` (and sharding
    the whole list once per new parameter list) every step."""
    grouped: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        grouped.setdefault((local.device, local.dtype), []).append(local)
    coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
    for (device, _), grads in grouped.items():
        if foreach is False:
            device_coef = coef.to(device)
            for grad in grads:
                grad.mul_(device_coef)
        else:  # foreach=None: torch picks foreach for plain CPU and CUDA tensors too; the op
            # loops over the tensors itself on a device without a multi-tensor kernel
            foreach_mul_(grads, coef.to(device))


class BaseTrainer:
    """The training loop without the model: steps, checkpoints, metrics, SIGTERM, callbacks.

    What a step computes is the subclass's (:meth:`train_step` over the batches of
    :meth:`data_iterator`); the loop runs the steps, reads their loss and gradient norm on log,
    validation and checkpoint steps only (no host sync in between), checkpoints through
    ``checkpointer``, stops cleanly on SIGTERM (a full checkpoint, ``stopped.json``), and
    calls the hooks of :attr:`callbacks` around all of it: the built-in metrics
    (:class:`hp_trainer.MetricsCallback`: console, JSONL, TensorBoard, W&B, loss plot)
    and profiler (:class:`hp_trainer.ProfilerCallback`), then ``job.callbacks``.

    A subclass sets, before :meth:`train`: ``rank``, ``world_size``, ``device``, ``run_folder``,
    ``metrics`` (a :class:`hp_trainer.MetricsProcessor`), ``checkpointer``
    (a :class:`hp_trainer.CheckpointManager` with the trainer as
    ``train_state``) and ``lr_schedulers``, then calls :meth:`install_callbacks`.

    Args:
        job_config: The configuration.

    See Also:
        HyperParallel's ``BaseTrainer``; :titan:`torchtitan.train.Trainer` (the loop part).
    """

    rank: int
    world_size: int
    device: torch.device
    run_folder: Path
    metrics: MetricsProcessor
    checkpointer: CheckpointManager
    lr_schedulers: Any

    def __init__(self, job_config: JobConfig) -> None:
        self.job_config = job_config
        self.callbacks = CallbackList()
        """The callbacks, called in order (built-ins first, then ``job.callbacks``)."""
        self.step = 0
        self.losses: list[float] = []
        """The global mean loss of every step run, read on log steps (and at the end)."""
        self.grad_norms: list[float] = []
        """The gradient norm of every step run, read with the losses."""
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._stop_requested = False
        self._last_saved_step = -1
        self._metrics_callback: MetricsCallback | None = None
        self._profiler_callback: ProfilerCallback | None = None
        self.ft: Any = None
        """The :class:`~hp_trainer.FTManager` under ``fault_tolerance.enable``."""
        self.stop_status: str | None = None
        """None when the run reached ``training.steps``; after a SIGTERM, ``"saved"`` when a
        checkpoint of the last completed step exists (resume by running again), else
        ``"unsaved"`` (checkpointing is off)."""

    # -- what a subclass provides ------------------------------------------------------------

    def train_step(self, batches: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns the global loss and gradient norm as device tensors.

        Raises:
            NotImplementedError: In the base class.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement train_step")

    def data_iterator(self) -> Iterator[Any]:
        """The batches of one step after another (what :meth:`train_step` takes).

        Raises:
            NotImplementedError: In the base class.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement data_iterator")

    def should_validate(self, step: int, last: bool) -> bool:
        """Whether to run :meth:`validate` after ``step`` (never, here)."""
        return False

    def validate(self) -> tuple[float, float]:
        """Run validation: ``(loss, perplexity)``.

        Raises:
            NotImplementedError: In the base class.
        """
        raise NotImplementedError(f"{type(self).__name__} has no validation")

    def log_extras(self) -> dict[str, Any] | None:
        """Further fields of a log step's record (None: none)."""
        return None

    # -- callbacks -------------------------------------------------------------------------------

    def install_callbacks(self) -> None:
        """Add the built-in callbacks, then one instance of each class of ``job.callbacks``."""
        self._metrics_callback = MetricsCallback(self.metrics)
        self.callbacks.append(self._metrics_callback)
        profiling = self.job_config.profiling
        if profiling.enable_profiling or profiling.enable_memory_snapshot:
            self._profiler_callback = ProfilerCallback(
                lambda: StepProfiler(profiling, self.run_folder, self.rank)
            )
            self.callbacks.append(self._profiler_callback)
        for spec in self.job_config.job.callbacks:
            self.callbacks.append(load_callback_class(spec)())

    def add_callback(self, callback: Any) -> None:
        """Add a callback after the others.

        Args:
            callback: Any object with some of the :class:`hp_trainer.Callback` hooks.
        """
        self.callbacks.append(callback)

    @property
    def profiler(self) -> StepProfiler | None:
        """The profiler of the last :meth:`train` (``[profiling]``), or None."""
        return None if self._profiler_callback is None else self._profiler_callback.profiler

    # -- the loop ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own checkpointed state (the step counter).

        Returns:
            ``{"step": step}``.

        See Also:
            :titan:`torchtitan.train.Trainer.state_dict`.
        """
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Args:
            state_dict: ``{"step": step}``.

        See Also:
            :titan:`torchtitan.train.Trainer.load_state_dict`.
        """
        self.step = int(state_dict["step"])

    def _should_stop(self) -> bool:
        """Whether any rank received SIGTERM: one all-reduce and read, made on read steps only.

        The check runs before the first step and after each step whose values were read (log
        steps, validation and checkpoint steps), where the host waits anyway; a stop requested
        in between takes effect at the next such step. One process needs no collective.
        """
        if not (dist.is_initialized() and self.world_size > 1):
            return self._stop_requested
        flag = torch.zeros(1, device=self.device)
        flag += float(self._stop_requested)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _read_pending(self) -> None:
        """Read the losses and norms of the steps since the last read (one host sync)."""
        if not self._pending:
            return
        steps = [step for step, _, _ in self._pending]
        pairs = [torch.stack([loss.float(), norm.float()]) for _, loss, norm in self._pending]
        values = torch.stack(pairs).tolist()
        self._pending.clear()
        for step, (loss, norm) in zip(steps, values, strict=True):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                raise RuntimeError(
                    f"non-finite training state at step {step}: loss {loss}, grad_norm {norm}"
                )
            self.losses.append(loss)
            self.grad_norms.append(norm)
            self.callbacks.call("on_step_values", self, step, loss, norm)

    @property
    def stop_record_path(self) -> Path:
        """``stopped.json`` in the run folder: written by rank 0 when SIGTERM stopped the run.

        It holds ``{"step", "status", "checkpoint"}`` (``status`` as :attr:`stop_status`);
        ``hp-train`` turns it into its exit status, and a run that starts again removes it.
        """
        return self.run_folder / "stopped.json"

    def _write_stop_record(self) -> None:
        if self.rank != 0:
            return
        saved = self.stop_status == "saved" and self.step > 0
        record = {
            "step": self.step,
            "status": self.stop_status,
            "checkpoint": str(self.checkpointer.step_dir(self.step)) if saved else None,
        }
        self.run_folder.mkdir(parents=True, exist_ok=True)
        self.stop_record_path.write_text(json.dumps(record) + "\n")

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._stop_requested = True

    def _run_step(self, batches: Any) -> bool:
        """One training step with its logging, validation and checkpoint.

        Returns:
            Whether the host read the step's values (a log, validation or checkpoint step):
            the trainer checks for a stop request after such steps only.
        """
        cfg = self.job_config.training
        if self.ft is not None:  # the quorum first: a restarted group recovers from a peer here
            batches = self.ft.begin_step(batches)
        self.step += 1
        step = self.step
        self.callbacks.call("on_step_begin", self, step)
        if cfg.gc_freq > 0 and step % cfg.gc_freq == 0:
            gc.collect(1)
        lr = self.lr_schedulers.get_last_lr()
        loss, norm = self.train_step(batches)
        if self.ft is not None and not self.ft.end_step():
            self.step -= 1  # the quorum did not commit it: the next step runs it again
            return False
        self._pending.append((step, loss, norm))
        self.callbacks.call("on_step_end", self, step)
        last = step == cfg.steps
        validate = self.should_validate(step, last)
        log = self.metrics.should_log(step)
        read = log or validate or last or self.checkpointer.is_due(step, last_step=last)
        if read:
            self._read_pending()
        if log:
            record = {"loss": self.losses[-1], "grad_norm": self.grad_norms[-1], "lr": lr}
            record.update(self.log_extras() or {})
            self.callbacks.call("on_log", self, step, record)
        if validate:
            val_loss, perplexity = self.validate()
            self.callbacks.call("on_validation_end", self, step, val_loss, perplexity)
        if self.checkpointer.save(step, last_step=last):
            self._last_saved_step = step
            self.callbacks.call("on_save", self, step)
        return read

    def train(self) -> list[float]:
        """Run up to ``training.steps`` steps, checkpointing per ``[checkpoint]``.

        With checkpointing enabled the run first resumes from the latest complete checkpoint
        (or ``load_step``, or ``initial_load_path``), saves every ``interval`` steps and at the
        last step, and on SIGTERM saves a full checkpoint of the step just completed and stops
        cleanly. With ``create_seed_checkpoint`` it only writes ``step-0`` and returns.

        Returns:
            The global mean loss of every step run by this call.

        See Also:
            :titan:`torchtitan.train.Trainer.train`.
        """
        cfg = self.job_config.training
        if self.job_config.checkpoint.create_seed_checkpoint:
            path = self.checkpointer.create_seed_checkpoint()
            if self.rank == 0:
                logger.info("seed checkpoint written to %s", path)
            return self.losses
        if self.checkpointer.load() and self.rank == 0:
            for step, error in self.checkpointer.skipped:
                logger.warning("skipped the corrupted checkpoint step-%d: %s", step, error)
            logger.info(
                "resumed from checkpoint step-%d in %s (training step %d)",
                self.checkpointer.loaded_step,
                self.checkpointer.folder,
                self.step,
            )
        self.callbacks.call("on_train_begin", self)
        if self.rank == 0:  # from an earlier, stopped part of this run
            self.stop_record_path.unlink(missing_ok=True)
        previous = None
        with contextlib.suppress(ValueError):  # not the main thread: no handler
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        gc_enabled = gc.isenabled()
        if cfg.gc_freq > 0:
            gc.disable()
            gc.collect(1)
        start = time.perf_counter()
        try:
            batches = self.data_iterator()
            check_stop = True  # before the first step, then after each step that was read
            while self.step < cfg.steps:
                if check_stop and self._should_stop():
                    if self.rank == 0:
                        logger.warning("SIGTERM received: stopping after step %d", self.step)
                    saved = self._last_saved_step == self.step or self.step == 0
                    if not saved and self.checkpointer.save(self.step, force=True):
                        saved = True
                        self.callbacks.call("on_save", self, self.step)
                        if self.rank == 0:
                            logger.info("saved %s", self.checkpointer.step_dir(self.step))
                    self.stop_status = "saved" if saved else "unsaved"
                    self._write_stop_record()
                    break
                check_stop = self._run_step(next(batches))
            self._read_pending()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if gc_enabled:
                gc.enable()
            self.callbacks.call("on_train_end", self)
        plot = None if self._metrics_callback is None else self._metrics_callback.plot
        if self.rank == 0:
            logger.info(
                "trained %d steps (now at step %d) in %.1f s; outputs in %s%s",
                len(self.losses),
                self.step,
                time.perf_counter() - start,
                self.run_folder,
                f" (loss curve: {plot.name})" if plot is not None else "",
            )
        return self.losses


class LLMTrainer(BaseTrainer):
    """The language-model trainer: tokens, loss, validation, and the PP / CP wiring.

    Builds model, parallelism, optimizer, data and metrics from a config; the loop is
    :class:`BaseTrainer`'s.

    Works in a process group started by a launcher (``torchrun``/``hp-train``: the group is
    created from the environment), in one that already exists (tests), or alone (world size 1,
    no process group). Steps: draw ``gradient_accumulation_steps`` micro-batches, all-reduce the
    number of label tokens over data-parallel ranks, run forward/backward with the loss summed
    and divided by that global count (FSDP's own gradient division is off), clip, step the
    optimizer and LR schedule, log, checkpoint. With ``checkpoint.enable`` a
    :class:`~hp_trainer.CheckpointManager` (built after the data loader, optimizers
    and schedulers, with the trainer's step as ``train_state``) resumes the run before the first
    step, saves after due steps and on SIGTERM, and is closed by :meth:`close`.

    Args:
        job_config: The configuration.

    Raises:
        ValueError: For a layout that cannot work (see
            ``hp_trainer.distributed.layout_validation.validate_parallel_layout``), checked before
            the process group is created, or inconsistent sizes.

    See Also:
        :titan:`torchtitan.train.Trainer`: TorchTitan's trainer.
    """

    def __init__(self, job_config: JobConfig) -> None:
        if job_config.parallelism.auto:  # the planner's layout for this world size
            from hp_trainer.planner.auto import resolve_auto_layout

            world = dist.get_world_size() if dist.is_initialized() else None
            job_config = resolve_auto_layout(job_config, world)
        super().__init__(job_config)
        cfg = job_config
        par = cfg.parallelism
        # every layout that cannot work fails here, before any process group exists
        job_world = dist.get_world_size() if dist.is_initialized() else None
        validate_parallel_layout(job_config, job_world or int(os.environ.get("WORLD_SIZE", "1")))

        # -- distributed ---------------------------------------------------------------------
        self._owns_process_group = False
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            hp_device.init_process_group()
            self._owns_process_group = True
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = hp_device.get_device()
        self.parallel_dims = parallel_dims_from_config(par, self.world_size)
        dims = self.parallel_dims
        self.dp_group: dist.ProcessGroup | None = None
        self.dp_rank = 0
        if self.world_size > 1:
            dims.build_mesh(self.device.type)
            dp_mesh = dims.get_mesh("dp")
            self.dp_group = dp_mesh.get_group()
            self.dp_rank = dp_mesh.get_local_rank()

        training = cfg.training
        if training.seq_len % dims.seq_len_divisor != 0:
            raise ValueError(
                f"training.seq_len = {training.seq_len} must be a multiple of "
                f"{dims.seq_len_divisor} (tensor-parallel degree, for sequence parallelism)"
            )
        micro_global = training.local_batch_size * dims.dp_degree
        global_batch = training.global_batch_size
        if global_batch == -1:
            global_batch = micro_global
        if global_batch % micro_global != 0:
            raise ValueError(
                f"training.global_batch_size = {global_batch} must be a multiple of "
                f"local_batch_size * dp degree = {micro_global}"
            )
        self.gradient_accumulation_steps = global_batch // micro_global
        self.global_batch_size = global_batch
        self.seed = training.seed if training.seed is not None else 0
        if training.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)

        # -- model -----------------------------------------------------------------------------
        self.model_spec: ModelSpec = get_model_spec(cfg.model.name)
        args = resolve_model_args(self.model_spec, cfg)
        self.tokenizer: HuggingFaceTokenizer = build_tokenizer(
            cfg.data.tokenizer_path, bos_token=cfg.data.bos_token, eos_token=cfg.data.eos_token
        )
        # block_causal: each micro-batch's document ids, from the tokenizer's BOS/EOS
        self.document_boundaries: DocumentBoundaries | None = None
        if cfg.model.attn_mask_type == "block_causal":
            self.document_boundaries = DocumentBoundaries(
                self.tokenizer.bos_id, self.tokenizer.eos_id
            )
        if self.tokenizer.vocab_size > args.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} ids but model "
                f"{cfg.model.name}/{cfg.model.flavor} has vocab_size {args.vocab_size}"
            )
        torch.manual_seed(self.seed)
        init_meta = cfg.model.init_device == "meta"
        with torch.device("meta") if init_meta else contextlib.nullcontext():
            model = self.model_spec.model_cls(args)
        if not init_meta:
            torch.manual_seed(self.seed)  # the same draws as the meta path's init below
            model.init_weights()  # type: ignore[operator]
        # model converters (--model.converters): rewrite the whole model before parallelising
        self.model_converters = build_model_converters(cfg, dims)
        self.model_converters.convert(model)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.num_flops_per_token = int(model.num_flops_per_token(training.seq_len))  # type: ignore[operator]
        self.loss_parallel_enabled = dims.tp_enabled and not par.disable_loss_parallel
        self._global_tokens = torch.ones((), device=self.device)
        self.pipeline: PipelinedStep | None = None
        if dims.pp_enabled:  # this rank's stages, FQNs unchanged (checkpoints load either way)
            assert self.model_spec.pipelining_fn is not None  # checked up front
            pipelined = self.model_spec.pipelining_fn(
                model, dims, cfg, self.device, self.model_spec.parallelize_fn, self._stage_loss
            )
            self.pipeline = PipelinedStep(pipelined, dims.get_mesh("pp").get_group())
            parts: list[nn.Module] = list(pipelined.model_parts)
        else:
            parts = [self.model_spec.parallelize_fn(model, dims, cfg)]
        for part in parts:
            if init_meta:
                part.to_empty(device=self.device)
                torch.manual_seed(self.seed)
                part.init_weights(buffer_device=self.device)  # type: ignore[operator]
                self.model_converters.init_weights(part)  # e.g. LoRA's adapters
            else:
                part.to(self.device)
            part.train()
        self.model = parts[0]
        self.model_parts = parts
        self.cp: ContextParallelStep | None = None
        if dims.cp_enabled:
            self.cp = ContextParallelStep(dims.get_mesh("cp"), par)
        # mixed precision: FSDP/HSDP gather parameters in the compute dtype; without them the
        # parameters stay float32 (master weights) and autocast computes in that dtype
        compute = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            training.mixed_precision_param
        )
        sharded = dims.dp_enabled or dims.cp_enabled
        self._autocast_dtype: torch.dtype | None = None if sharded else compute

        # -- optimizer, schedule, data, metrics -------------------------------------------------
        self.param_offload: ParamOffloader | None = None
        if cfg.offload.params:  # hyper-offload: parameters in host memory, copied in per block
            self.param_offload = offload_params(self.model_parts, device=self.device)
        self.optimizers = build_optimizers(self.model_parts, cfg.optimizer)
        if cfg.offload.optimizer:  # hyper-offload: optimizer state and step in host memory
            self.optimizers = offload_optimizers(self.optimizers, job_config=cfg)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, training.steps, cfg.lr_scheduler)
        # MoE: routing-bias update and expert-load metrics, counts summed over dp x cp
        self.expert_load = ExpertLoadTracker(
            self.model_parts,
            dims.get_mesh("dp_cp").get_group() if self.world_size > 1 else None,
            pipeline_group=dims.get_mesh("pp").get_group() if self.pipeline is not None else None,
            hot_expert_replicas=cfg.moe.hot_expert_replicas,
            hot_expert_update_interval=cfg.moe.hot_expert_update_interval,
        )
        self.dataset: TokenizedDataset | PreparedTokenDataset | None = None  # None: streamed
        self.dataloader: ParallelAwareDataloader | StreamingTextLoader
        if cfg.data.streaming:  # tokenized on the fly, each dp rank its part
            self.dataloader = StreamingTextLoader(
                cfg.data.dataset,
                self.tokenizer,
                training.seq_len,
                self.dp_rank,
                dims.dp_degree,
                training.local_batch_size,
                text_field=cfg.data.jsonl_text_field,
                dp_group=self.dp_group,
            )
        else:
            self.dataset = self._build_dataset(cfg.data.dataset, args.vocab_size)
            self.dataloader = ParallelAwareDataloader(
                self.dataset,
                self.dp_rank,
                dims.dp_degree,
                training.local_batch_size,
                seed=self.seed,
                shuffle=cfg.data.shuffle,
            )
        self.validator: Validator | None = None
        if cfg.validation.enable:
            self.validator = Validator(
                cfg.validation,
                self._build_dataset(cfg.validation.dataset, args.vocab_size),
                self.dp_rank,
                dims.dp_degree,
                dp_group=self.dp_group,
                loss_context=self._loss_context,
                device=self.device,
                document_boundaries=self.document_boundaries,
                pipeline=self.pipeline,
            )
        self.run_folder = cfg.run_folder
        self.metrics = MetricsProcessor(
            cfg.metrics,
            self.run_folder,
            self.rank,
            training.steps,
            self.num_flops_per_token,
            dims.non_data_parallel_size,
        )
        adapter_cls = self.model_spec.state_dict_adapter
        sd_adapter = adapter_cls(args) if adapter_cls is not None else None
        self.checkpointer = CheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self, **self.model_converters.checkpoint_states()},
            checkpoint_config=cfg.checkpoint,
            sd_adapter=sd_adapter,
            base_folder=self.run_folder,
            model_key_filter=self.model_converters.model_key_filter(),
            hf_export_transform=self.model_converters.hf_export_transform(sd_adapter),
            preload_states=tuple(self.model_converters.checkpoint_states()),
        )
        if cfg.checkpoint.create_seed_checkpoint:
            if not cfg.checkpoint.enable:
                raise ValueError(
                    "checkpoint.create_seed_checkpoint = true needs checkpoint.enable = true"
                )
            if self.world_size != 1:
                raise ValueError(
                    "checkpoint.create_seed_checkpoint = true must run on one process (the seed "
                    f"checkpoint loads into any layout); got world size {self.world_size}"
                )
        if cfg.fault_tolerance.enable:  # this job is one replica group (torchft)
            from hp_trainer.components.ft import FTManager

            self.ft = FTManager(self)
        self.install_callbacks()
        self._log_startup()

    # -- the LLM parts of the loop ---------------------------------------------------------------

    def should_validate(self, step: int, last: bool) -> bool:
        """Whether ``[validation]`` is due after ``step``.

        Args:
            step: The step just completed.
            last: Whether it is the last step.

        Returns:
            True when validation is enabled and due.
        """
        return self.validator is not None and self.validator.should_validate(step, last)

    def validate(self) -> tuple[float, float]:
        """The validation loss and perplexity of the current model (collective).

        Returns:
            ``(loss, perplexity)``.
        """
        assert self.validator is not None
        return self.validator.validate(self.model)

    def log_extras(self) -> dict[str, Any] | None:
        """The MoE expert load of the last step (None without MoE layers)."""
        return self.expert_load.metrics()

    # -- helpers -------------------------------------------------------------------------------

    def _log_startup(self) -> None:
        if self.rank != 0:
            return
        cfg = self.job_config
        d = self.parallel_dims
        tokens = self.global_batch_size * cfg.training.seq_len
        logger.info(
            "world %d on %s: pp %d x dp_replicate %d x dp_shard %d x cp %d x tp %d (ep %d)",
            self.world_size,
            self.metrics.device_name,
            d.pp,
            d.dp_replicate,
            d.dp_shard,
            d.cp,
            d.tp,
            d.ep,
        )
        logger.info(
            "model %s/%s: %s parameters, %.2f MFLOP per token",
            cfg.model.name,
            cfg.model.flavor,
            f"{self.num_params:,}",
            self.num_flops_per_token / 1e6,
        )
        logger.info(
            "data %s: %s samples of %d tokens; global batch %d (%d tokens/step), "
            "gradient accumulation %d",
            cfg.data.dataset,
            "streamed" if self.dataset is None else len(self.dataset),
            cfg.training.seq_len,
            self.global_batch_size,
            tokens,
            self.gradient_accumulation_steps,
        )
        logger.info("outputs: %s", self.run_folder)
        self.run_folder.mkdir(parents=True, exist_ok=True)
        (self.run_folder / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    def _build_dataset(self, path: str, vocab_size: int) -> TokenizedDataset | PreparedTokenDataset:
        """Samples of ``training.seq_len`` from a prepared folder or from text/JSONL files."""
        cfg = self.job_config
        seq_len = cfg.training.seq_len
        if not is_prepared_corpus(path):
            documents = load_documents(path, cfg.data.jsonl_text_field)
            return TokenizedDataset(documents, self.tokenizer, seq_len)
        prepared = PreparedTokenDataset(path, seq_len)  # hp-train-prepare's shards, mmap'ed
        if prepared.vocab_size > vocab_size:
            raise ValueError(
                f"the prepared corpus {path} was tokenized with {prepared.vocab_size} ids but "
                f"model {cfg.model.name}/{cfg.model.flavor} has vocab_size {vocab_size}"
            )
        return prepared

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16/fp16 compute without FSDP (which casts parameters itself); else nothing."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _loss_context(self) -> contextlib.AbstractContextManager[Any]:
        return loss_parallel() if self.loss_parallel_enabled else contextlib.nullcontext()

    def _all_reduce_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None and self.parallel_dims.dp_degree > 1:
            dist.all_reduce(tensor, group=self.dp_group)
        return tensor

    def _all_reduce_loss(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over dp x cp: each CP rank holds the loss of its sequence shard."""
        if self.world_size > 1 and self.parallel_dims.get_mesh("loss").size() > 1:
            dist.all_reduce(tensor, group=self.parallel_dims.get_mesh("loss").get_group())
        return tensor

    def _stage_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's loss of one micro-batch: token sum / step's tokens."""
        return summed_token_loss(logits, labels) / self._global_tokens

    @contextlib.contextmanager
    def _sequence_shard(
        self, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Under CP: this rank's sequence shards, RoPE sharded, attention context-parallel.

        Yields inputs, labels and the document ids the model takes (None under CP, where the
        context-parallel attention holds this rank's shard of them).
        """
        if self.cp is None:
            yield inputs, labels, document_ids
            return
        shards = self.cp.sharded(self.model_parts, inputs, labels, document_ids=document_ids)
        with shards as (local_inputs, local_labels):
            yield local_inputs, local_labels, None

    # -- step ----------------------------------------------------------------------------------

    def forward_backward_step(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch.

        Args:
            inputs: ``(batch, seq)`` token ids.
            labels: ``(batch, seq)`` next-token ids (``-100`` ignored).
            global_valid_tokens: Label tokens of the whole step over all DP ranks.
            document_ids: Keyword-only extension: ``(batch, seq)`` document ids of the packed
                inputs (``model.attn_mask_type = "block_causal"``); None: causal attention.

        Returns:
            The detached loss contribution (sum over tokens / global count).

        See Also:
            :titan:`torchtitan.train.Trainer.forward_backward_step`.
        """
        if self.pipeline is not None:  # loss on the last stage, shared over the pipeline
            self._global_tokens = global_valid_tokens
            with self._autocast():  # bf16/fp16 compute when no FSDP casts the parameters
                return self.pipeline.run(
                    inputs, labels, self._loss_context, document_ids=document_ids
                )
        with self._autocast():
            if document_ids is None:
                logits = self.model(inputs)
            else:
                logits = self.model(inputs, document_ids=document_ids)
        # Loss parallel around the loss and its backward, not the forward: a torch-function
        # mode sends every torch call made inside it through a Python handler, a host cost per
        # op (the backward's ops run in the autograd engine, which the mode does not see).
        # PyTorch's loss_parallel needs its backward inside; hp-tp's does not. Under PP the
        # schedule runs the loss and its backward, so the context surrounds the schedule's step.
        with self._loss_context():
            loss = summed_token_loss(logits, labels) / global_valid_tokens
            loss.backward()  # type: ignore[no-untyped-call]
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        return loss.detach()

    def train_step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches, no host sync.

        The token count, the loss and the gradient norm stay on the device: nothing here waits
        for the accelerator (no ``.item()``). ``train()`` reads the values on log steps only
        (one read for all the steps since the last one) and checks there that they are finite.

        Args:
            batches: ``(inputs, labels)`` micro-batches of this rank.

        Returns:
            ``(global mean loss, total gradient norm before clipping)``, 0-dim tensors on the
            device (reading one is a host sync).

        See Also:
            :titan:`torchtitan.train.Trainer.train_step`.
        """
        self.optimizers.zero_grad()
        local_tokens = torch.stack([(labels != IGNORE_INDEX).sum() for _, labels in batches]).sum()
        global_tokens = self._all_reduce_dp(local_tokens.to(self.device, torch.float32))
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            inputs = inputs.to(self.device)
            labels = labels.to(self.device)
            documents = None
            if self.document_boundaries is not None:
                documents = self.document_boundaries.document_ids(inputs)
            with self._sequence_shard(inputs, labels, documents) as (
                local_inputs,
                local_labels,
                local_documents,
            ):
                loss_sum += self.forward_backward_step(
                    local_inputs, local_labels, global_tokens, document_ids=local_documents
                )
            self.metrics.add_tokens(inputs.numel())
        params = [p for part in self.model_parts for p in part.parameters()]
        if self.ft is not None:  # the replicate all-reduce across replica groups (torchft)
            self.ft.reduce_gradients(params)
        pp_mesh = self.parallel_dims.get_mesh("pp") if self.pipeline is not None else None
        grad_norm = clip_grad_norm_(params, self.job_config.training.max_norm, pp_mesh=pp_mesh)
        loss = self._all_reduce_loss(loss_sum)
        # a background checkpoint stager may still be copying the weights of the previous step
        self.checkpointer.maybe_wait_for_staging()
        if self.ft is None or self.ft.should_commit():  # the quorum's vote (torchft)
            self.optimizers.step()
            self.model_converters.post_optimizer_hook(self.model_parts)
            self.expert_load.step()
            self.lr_schedulers.step()
        return loss.detach(), grad_norm.detach()

    def data_iterator(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """The ``gradient_accumulation_steps`` micro-batches of one step after another."""
        if self.ft is not None:  # drawn after each step's quorum (hp_trainer.components.ft)
            while True:
                yield []
        it = iter(self.dataloader)
        while True:
            yield [next(it) for _ in range(self.gradient_accumulation_steps)]

    def close(self) -> None:
        """Release resources; destroys the process group if this trainer created it.

        See Also:
            :titan:`torchtitan.train.Trainer.close`.
        """
        if self.ft is not None:
            self.ft.shutdown()
        self.checkpointer.close()
        self.metrics.close()
        if isinstance(self.dataloader, StreamingTextLoader):
            self.dataloader.close()  # its readers' files, before interpreter teardown
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False


class Trainer(LLMTrainer):
    """TorchTitan's name for the trainer users run: the :class:`LLMTrainer`.

    Args:
        job_config: The configuration.

    See Also:
        :titan:`torchtitan.train.Trainer`: TorchTitan's trainer.
    """
