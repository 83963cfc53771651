"""The validation loop: loss and perplexity of the model on held-out data, over all DP ranks."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hp_trainer.components.data.dataset import ParallelAwareDataloader, SampleDataset
from hp_trainer.components.loss import IGNORE_INDEX, summed_token_loss
from hp_trainer.config import ValidationConfig
from hp_trainer.models.common.document_mask import DocumentBoundaries

if TYPE_CHECKING:
    from hp_trainer.distributed.pipeline import PipelinedStep

__all__ = ["Validator"]


class Validator:
    """Evaluate the mean next-token loss (and its perplexity) on a validation dataset.

    Every validation reads the same batches: the dataset in file order, cut into global
    batches of ``local_batch_size x dp degree`` and sharded over the data-parallel ranks like the
    training data; ``steps`` batches, or one pass over all complete global batches with
    ``steps = -1``. The loss is the sum over every label token of every rank divided by their
    global count, so it does not depend on the data-parallel degree. Under pipeline parallel
    the batches run forward only through the pipeline schedule, the loss on the last stage,
    shared with every rank of the pipeline.

    Args:
        config: The ``[validation]`` section.
        dataset: The validation samples.
        dp_rank: This rank's data-parallel index.
        dp_degree: The data-parallel degree.
        dp_group: Keyword-only; the data-parallel process group (None: no reduction).
        loss_context: Keyword-only; context of the loss (loss parallel under TP).
        device: Keyword-only; where the batches go.
        document_boundaries: Keyword-only; BOS/EOS of packed documents when the model
            attends block-causally (``model.attn_mask_type = "block_causal"``), else None.
        pipeline: Keyword-only; the trainer's pipelined step under pipeline parallel (the
            model passed to ``validate`` is then ignored: the schedule's stages run), or
            None.

    Raises:
        ValueError: If the dataset is smaller than one global batch, or (under pipeline
            parallel) ``local_batch_size`` is not a multiple of the training local batch.

    See Also:
        :titan:`torchtitan.components.validate.Validator`: TorchTitan's validator.
    """

    def __init__(
        self,
        config: ValidationConfig,
        dataset: SampleDataset,
        dp_rank: int,
        dp_degree: int,
        *,
        dp_group: dist.ProcessGroup | None = None,
        loss_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        device: torch.device | None = None,
        document_boundaries: DocumentBoundaries | None = None,
        pipeline: PipelinedStep | None = None,
    ) -> None:
        self.config = config
        self.dataset = dataset
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.dp_group = dp_group
        self.loss_context = loss_context
        self.device = device or torch.device("cpu")
        self.document_boundaries = document_boundaries
        self.pipeline = pipeline
        if pipeline is not None and config.local_batch_size % pipeline.parts.batch_size:
            raise ValueError(
                f"validation.local_batch_size = {config.local_batch_size} must be a multiple of "
                f"training.local_batch_size = {pipeline.parts.batch_size} under pipeline "
                "parallel (the activation shapes the stages exchange)"
            )
        global_batch = config.local_batch_size * dp_degree
        if len(dataset) < global_batch:
            raise ValueError(
                f"the validation dataset {config.dataset!r} has {len(dataset)} samples, fewer "
                f"than one global batch of {global_batch} (validation.local_batch_size "
                f"{config.local_batch_size} x dp {dp_degree})"
            )
        self.num_batches = config.steps if config.steps > 0 else len(dataset) // global_batch

    def should_validate(self, step: int, last_step: bool = False) -> bool:
        """Whether to validate after training step ``step``.

        Args:
            step: The 1-based step just completed.
            last_step: Whether it is the run's last step.

        Returns:
            True every ``freq`` steps and at the last step.

        See Also:
            :titan:`torchtitan.components.validate.Validator.should_validate`.
        """
        return last_step or step % self.config.freq == 0

    @torch.no_grad()
    def validate(self, model: nn.Module) -> tuple[float, float]:
        """Run the validation batches through ``model`` (every rank must call it).

        Args:
            model: The (parallelized) model; put in eval mode for the pass, then back (under
                pipeline parallel: the pipeline's stage modules instead).

        Returns:
            ``(mean loss, perplexity)`` over all label tokens of all data-parallel ranks.

        See Also:
            :titan:`torchtitan.components.validate.Validator.validate`.
        """
        loader = ParallelAwareDataloader(
            self.dataset,
            self.dp_rank,
            self.dp_degree,
            self.config.local_batch_size,
            shuffle=False,
        )
        modules = [model] if self.pipeline is None else self.pipeline.parts.model_parts
        was_training = [m.training for m in modules]
        for module in modules:
            module.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
        try:
            batches = iter(loader)
            for _ in range(self.num_batches):
                inputs, labels = next(batches)
                inputs, labels = inputs.to(self.device), labels.to(self.device)
                documents = None
                if self.document_boundaries is not None:
                    documents = self.document_boundaries.document_ids(inputs)
                if self.pipeline is not None:
                    totals[0] += self.pipeline.evaluate(
                        inputs,
                        labels,
                        summed_token_loss,
                        self.loss_context,
                        document_ids=documents,
                    ).to(totals.device)
                else:
                    if documents is None:
                        logits = model(inputs)
                    else:
                        logits = model(inputs, document_ids=documents)
                    with self.loss_context():  # the loss only, not the forward (see Trainer)
                        loss = summed_token_loss(logits, labels)
                    if isinstance(loss, DTensor):
                        loss = loss.full_tensor()
                    totals[0] += loss.double()
                totals[1] += int((labels != IGNORE_INDEX).sum())
        finally:
            for module, training in zip(modules, was_training, strict=True):
                module.train(training)
        if self.dp_group is not None and self.dp_degree > 1:
            dist.all_reduce(totals, group=self.dp_group)
        mean = float(totals[0] / totals[1])
        return mean, math.exp(min(mean, 700.0))
