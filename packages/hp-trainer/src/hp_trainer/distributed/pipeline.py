"""Pipeline parallelism for the trainer: split a decoder into stages and run one step of them.

:func:`pipeline_decoder` is the ``pipelining_fn`` of the decoder ``ModelSpec`` s: it splits the
whole (initialized) model with hp-pp's cost-balanced splitter, which keeps every FQN, applies the
model's parallelize function (TP, AC, compile, FSDP) to each stage module, and builds the
schedule named by ``parallelism.pipeline_parallel_schedule`` (or read from
``parallelism.pipeline_parallel_schedule_csv``). :class:`PipelinedStep` runs one micro-batch
group through that schedule: inputs on the first stage, the loss on the last, the loss sum shared
with every rank of the pipeline so that logging works on any rank; its ``evaluate`` runs the
schedule forward only, for the validation loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from hp_pp import PipelineScheduleRuntime
    from hp_trainer.config import JobConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = ["PipelinedStep", "pipeline_decoder", "stages_per_rank_of"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stages_per_rank_of(schedule: str) -> int:
    """Stages each pipeline rank holds under a built-in schedule (1 or 2).

    Args:
        schedule: A schedule name accepted by :func:`hp_pp.get_schedule_class`.

    Returns:
        1 for single-stage schedules (GPipe, 1F1B), 2 for the multi-stage ones.

    Raises:
        ValueError: An unknown schedule name (the message lists the valid ones).

    See Also:
        :titan:`torchtitan.distributed.pipeline_parallel.pipeline_module_split`: TorchTitan's
        placement (one or several stages per rank, by schedule type).
    """
    from hp_pp import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(schedule)
    return 1 if issubclass(cls, PipelineScheduleSingle) else 2


@dataclass(frozen=True)
class PipelineParts:
    """What ``pipeline_decoder`` builds on this rank.

    Attributes:
        schedule: The schedule over this rank's stages.
        model_parts: This rank's stage modules (parallelized), in stage order.
        has_first_stage: Whether this rank runs the first stage (it feeds the inputs).
        has_last_stage: Whether this rank runs the last stage (it computes the loss).
        batch_size: Samples of one schedule run on this rank (``training.local_batch_size``):
            the stages' activation shapes are fixed by it.

    See Also:
        :titan:`torchtitan.distributed.pipeline_parallel.pipeline_llm`: returns the same
        (schedule, model parts, first/last stage flags).
    """

    schedule: PipelineScheduleRuntime
    model_parts: list[nn.Module]
    has_first_stage: bool
    has_last_stage: bool
    batch_size: int


def pipeline_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    parallelize_fn: Callable[[nn.Module, ParallelDims, JobConfig], nn.Module],
    loss_fn: LossFn,
) -> PipelineParts:
    """Split a decoder into pipeline stages, parallelize each, and build the schedule.

    Stages get contiguous blocks balanced by cost (the embedding and the head each count as one
    block); single-stage schedules hold one stage per rank, multi-stage ones two (in a loop or a
    V, as the schedule places them). Gradients are not scaled by the number of micro-batches:
    the trainer's loss is already divided by the step's global token count.

    Args:
        model: The whole decoder, initialized (same weights as an unpipelined run).
        parallel_dims: Degrees and meshes (``build_mesh`` done; ``pp > 1``).
        job_config: The job configuration (``[parallelism]`` schedule options,
            ``training.local_batch_size``).
        device: Device of the stages.
        parallelize_fn: The model's parallelize function, applied to every stage module.
        loss_fn: ``loss_fn(logits, labels)`` run on the last stage.

    Returns:
        The schedule, this rank's stage modules and which ends of the pipeline it holds.

    Raises:
        ValueError: A micro-batch size that does not divide the local batch, or a split the
            schedule cannot place.

    See Also:
        :titan:`torchtitan.distributed.pipeline_parallel.pipeline_llm`: TorchTitan's function.
    """
    # hp-pp (and torch.distributed.pipelining, which imports torch._dynamo) is imported by the
    # jobs that pipeline, not by every process that imports hp_trainer
    from hp_pp import generate_llm_fqn_per_model_part, pipeline_llm

    par = job_config.parallelism
    local_batch = job_config.training.local_batch_size
    if local_batch % par.pipeline_parallel_microbatch_size:
        raise ValueError(
            f"parallelism.pipeline_parallel_microbatch_size = "
            f"{par.pipeline_parallel_microbatch_size} must divide training.local_batch_size = "
            f"{local_batch}"
        )
    n_microbatches = local_batch // par.pipeline_parallel_microbatch_size
    stages_per_rank = stages_per_rank_of(par.pipeline_parallel_schedule)
    fqns = generate_llm_fqn_per_model_part(
        parallel_dims.pp * stages_per_rank,
        len(list(model.get_submodule("layers").children())),
        output_fqns=("norm", "lm_head"),
    )
    schedule, parts, has_first, has_last = pipeline_llm(
        model,
        pp_mesh=parallel_dims.get_mesh("pp"),
        schedule=par.pipeline_parallel_schedule,
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        device=device,
        stages_per_rank=stages_per_rank,
        module_fqns_per_model_part=fqns,
        parallelize_fn=lambda part: parallelize_fn(part, parallel_dims, job_config),
        scale_grads=False,
        # the local batch is validated to divide into the micro-batches: no per-message
        # shape header, so no host read per received activation
        shape_headers=False,
    )
    if par.pipeline_parallel_schedule_csv:
        schedule.load_csv(par.pipeline_parallel_schedule_csv)
    return PipelineParts(schedule, parts, has_first, has_last, local_batch)


class PipelinedStep:
    """Forward and backward of one local batch through a pipeline schedule.

    Args:
        parts: What ``pipeline_decoder`` built.
        pp_group: The pipeline process group (the loss is shared over it).

    See Also:
        :titan:`torchtitan.train.Trainer.forward_backward_step`: TorchTitan's PP branch.
    """

    def __init__(self, parts: PipelineParts, pp_group: dist.ProcessGroup) -> None:
        self.parts = parts
        self.pp_group = pp_group

    def run(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        context: Callable[[], contextlib.AbstractContextManager[Any]],
        *,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the schedule's step on one local batch.

        Args:
            inputs: ``(batch, seq)`` token ids (used on the rank of the first stage).
            labels: ``(batch, seq)`` targets (used on the rank of the last stage).
            context: Entered around the step (loss parallel under TP).
            document_ids: ``(batch, seq)`` document ids of the packed inputs (block-causal
                attention): split into micro-batches like the inputs and given to every stage.

        Returns:
            The sum of the micro-batch losses, the same on every rank of the pipeline.
        """
        parts = self.parts
        losses: list[Any] = []
        target = labels if parts.has_last_stage else None
        args = (inputs,) if parts.has_first_stage else ()
        # keyword inputs reach every stage, chunked like the inputs (hp-pp's schedules)
        kwargs: dict[str, Any] = {} if document_ids is None else {"document_ids": document_ids}
        with context():
            parts.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        total = torch.zeros((), device=inputs.device)
        for loss in losses:
            value = loss.full_tensor() if isinstance(loss, DTensor) else loss
            total += value.detach().to(total.device)
        dist.all_reduce(total, group=self.pp_group)
        return total

    def evaluate(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        loss_sum: LossFn,
        context: Callable[[], contextlib.AbstractContextManager[Any]],
        *,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward only through the schedule (no backward, no gradient): a batch's summed loss.

        The batch is run in pieces of ``PipelineParts.batch_size`` samples (the activation
        shapes the stages exchange are those of training).

        Args:
            inputs: ``(batch, seq)`` token ids, ``batch`` a multiple of the training local batch.
            labels: ``(batch, seq)`` targets (used on the rank of the last stage).
            loss_sum: ``loss_sum(logits, labels)`` of one piece, run on the last stage.
            context: Entered around each piece (loss parallel under TP).
            document_ids: ``(batch, seq)`` document ids of the packed inputs, or None.

        Returns:
            The float64 sum of ``loss_sum`` over the pieces, the same on every pipeline rank.

        Raises:
            ValueError: A batch that is not a multiple of the training local batch.

        See Also:
            :titan:`torchtitan.components.validate.Validator.validate`: TorchTitan's PP branch
            (``pp_schedule.eval``).
        """
        parts = self.parts
        size = parts.batch_size
        if inputs.shape[0] % size:
            raise ValueError(
                f"a pipelined evaluation batch of {inputs.shape[0]} samples is not a multiple of "
                f"training.local_batch_size = {size} (the shapes the stages exchange)"
            )
        total = torch.zeros((), dtype=torch.float64, device=inputs.device)
        for start in range(0, inputs.shape[0], size):
            piece = slice(start, start + size)
            args = (inputs[piece],) if parts.has_first_stage else ()
            kwargs: dict[str, Any] = {}
            if document_ids is not None:
                kwargs["document_ids"] = document_ids[piece]
            # The schedule's own loss_fn (the training loss, scaled by the step's token count)
            # needs a target on the last stage; the summed loss is taken from the merged logits.
            target = labels[piece] if parts.has_last_stage else None
            with context():
                logits = parts.schedule.eval(*args, target=target, **kwargs)
                if parts.has_last_stage:
                    loss = loss_sum(logits, labels[piece])
                    if isinstance(loss, DTensor):
                        loss = loss.full_tensor()
                    total += loss.detach().double().to(total.device)
        dist.all_reduce(total, group=self.pp_group)
        return total
