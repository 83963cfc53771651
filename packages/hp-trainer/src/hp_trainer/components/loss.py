"""The next-token loss the trainer, the pipeline stages and validation compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "summed_token_loss"]

IGNORE_INDEX = -100
"""Label of a position that has no next token (cross-entropy's default ``ignore_index``)."""


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the tokens of a batch (the caller divides by the token count).

    Under tensor parallel the caller enters ``loss_parallel`` around this call (and the
    backward), so that vocabulary-sharded logits stay sharded.

    Args:
        logits: ``(batch, seq, vocab)`` logits, a tensor or a DTensor; computed in float32.
        labels: ``(batch, seq)`` next-token ids, ``IGNORE_INDEX`` where there is none.

    Returns:
        The scalar sum of the tokens' losses.

    See Also:
        :titan:`torchtitan.components.loss`: TorchTitan's loss functions (a mean per token).
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(0, 1),
        reduction="sum",
        ignore_index=IGNORE_INDEX,
    )
