"""Which sequence chunks each context-parallel rank holds.

The global sequence is cut into ``cp`` chunks (plain sharding: rank ``r`` holds chunk ``r``) or
``2 * cp`` chunks (head-tail "zigzag" load balancing for causal masks: rank ``r`` holds chunks
``r`` and ``2 * cp - 1 - r``, so that every rank has the same amount of causal work). Ranks are
numbered by their flat (row-major) index in the context-parallel mesh.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkLayout:
    """The chunk ids of every flat context-parallel rank."""

    cp: int
    load_balance: bool

    @property
    def num_chunks(self) -> int:
        return 2 * self.cp if self.load_balance else self.cp

    def chunks_of(self, flat_rank: int) -> tuple[int, ...]:
        """The chunk ids rank ``flat_rank`` holds, in the order its local tensor stores them."""
        if self.load_balance:
            return (flat_rank, 2 * self.cp - 1 - flat_rank)
        return (flat_rank,)

    def check_length(self, seq_len: int) -> None:
        """Raise ``ValueError`` unless ``seq_len`` splits into equal chunks."""
        if seq_len % self.num_chunks:
            how = "2 x cp (load-balanced)" if self.load_balance else "cp"
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {how} = {self.num_chunks}; "
                f"pad the sequence to a multiple of {self.num_chunks}"
            )
