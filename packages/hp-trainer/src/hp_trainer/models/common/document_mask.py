"""Document masking of packed sequences: per-position document ids and the block-causal mask.

A packed training sample concatenates documents separated by the tokenizer's BOS/EOS. With
``model.attn_mask_type = "block_causal"`` a position attends only to earlier positions of its
own document. The document ids are a function of the sample's tokens alone (a document starts
at a BOS and right after an EOS), so every data source gets them for free and a resumed run
recomputes the same ids from the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DocumentBoundaries", "block_causal_mask"]


@dataclass(frozen=True)
class DocumentBoundaries:
    """The special tokens that separate the documents of a packed sequence.

    A new document starts at every ``bos_id`` and at the position right after every
    ``eos_id`` (a BOS that follows an EOS starts one document, not two). Positions before
    the first boundary of a sample belong to document 0 (the tail of a document cut by the
    sample window).

    Args:
        bos_id: Token id that begins a document, or None.
        eos_id: Token id that ends a document, or None.

    Raises:
        ValueError: If both are None (documents could not be told apart).

    See Also:
        :titan:`torchtitan.models.attention.get_document_mask_mod`: TorchTitan derives documents
        from EOS ids inside the model.
    """

    bos_id: int | None
    eos_id: int | None

    def __post_init__(self) -> None:
        if self.bos_id is None and self.eos_id is None:
            raise ValueError(
                "document masking needs a BOS or an EOS id to find document boundaries; got "
                "neither (set --data.bos_token / --data.eos_token)"
            )

    def document_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Per-position document index of packed token sequences.

        Args:
            tokens: ``(..., seq)`` integer token ids.

        Returns:
            ``(..., seq)`` int64 ids, counting from 0 in each sequence and increasing by one at
            each document start.

        Raises:
            TypeError: If ``tokens`` is not an integer tensor.
        """
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        starts = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
        if self.bos_id is not None:
            starts |= tokens == self.bos_id
        if self.eos_id is not None:
            starts[..., 1:] |= tokens[..., :-1] == self.eos_id
        # the first position opens document 0 whatever it holds
        starts[..., 0] = False
        return starts.to(torch.int64).cumsum(-1)


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask: query ``i`` sees key ``j`` iff ``j <= i`` in the same document.

    The mask is dense, ``batch x seq x seq`` booleans (one byte each), built once per forward
    and shared by every layer and head.

    Args:
        document_ids: ``(batch, seq)`` integer document ids
            (:meth:`DocumentBoundaries.document_ids`).

    Returns:
        ``(batch, 1, seq, seq)`` bool mask for ``F.scaled_dot_product_attention``'s
        ``attn_mask`` (True: attend).

    Raises:
        ValueError: If ``document_ids`` is not 2-D.

    See Also:
        :pt:`torch.nn.attention.flex_attention.create_block_mask`: the block-sparse form of the
        same mask (TorchTitan's block-causal mask with FlexAttention).
    """
    if document_ids.dim() != 2:
        raise ValueError(
            f"document_ids must be (batch, seq), got shape {tuple(document_ids.shape)}"
        )
    seq = document_ids.shape[-1]
    same_document = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return (same_document & causal).unsqueeze(1)
