"""The packed token ids of corpora this process tokenized, kept for its later datasets.

A process that builds several datasets of one corpus (a driver or notebook running several
trainers, a sweep, a test session's warm workers) tokenizes it once. Entries are keyed by
content, not by path or object identity: the tokenizer's
:attr:`~hp_trainer.components.tokenizer.HuggingFaceTokenizer.fingerprint` and a BLAKE2 digest
of the documents, so an edited file or another tokenizer is tokenized again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

__all__ = ["TokenIdCache", "token_id_cache"]

DEFAULT_LIMIT_BYTES = 64 * 2**20
"""Bytes of token ids :func:`token_id_cache` keeps (int64: 8M tokens)."""


def documents_digest(documents: list[str]) -> bytes:
    """A BLAKE2b digest of the documents, their boundaries included."""
    digest = hashlib.blake2b(digest_size=20)
    for doc in documents:
        data = doc.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()


class TokenIdCache:
    """Least-recently-used token id tensors, up to ``limit_bytes`` in all.

    The tensors handed out are shared by every dataset of the same corpus: readers take views
    and copies (:class:`~hp_trainer.components.data.dataset.ParallelAwareDataloader` stacks
    samples), never write into them. A corpus larger than the limit is tokenized and returned
    without being kept.

    Args:
        limit_bytes: Keyword-only; the most bytes of ids kept (0 keeps nothing).

    Raises:
        ValueError: If ``limit_bytes`` is negative.

    See Also:
        ``datasets.Dataset.map``: HF datasets' cache of a tokenized corpus (on disk, by content).
    """

    def __init__(self, *, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()  # datasets may be built from several threads
        self.hits = 0
        """Lookups answered from the cache."""
        self.misses = 0
        """Lookups that tokenized."""

    @property
    def nbytes(self) -> int:
        """Bytes of ids kept now."""
        return sum(t.numel() * t.element_size() for t in self._entries.values())

    def get(self, key: Hashable, tokenize: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The ids under ``key``, from ``tokenize()`` on a miss (then kept if they fit).

        Args:
            key: The corpus's and tokenizer's content key.
            tokenize: Builds the 1-D id tensor.

        Returns:
            The ids (shared with the cache when kept: do not write into them).
        """
        with self._lock:
            self._evict()  # to a limit lowered since the last call
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        ids = tokenize()  # outside the lock: another corpus may be looked up meanwhile
        size = ids.numel() * ids.element_size()
        with self._lock:
            if size <= self.limit_bytes:
                self._entries[key] = ids
                self._evict()
        return ids

    def _evict(self) -> None:
        while self._entries and self.nbytes > self.limit_bytes:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry (the counters stay)."""
        with self._lock:
            self._entries.clear()


_CACHE = TokenIdCache()


def token_id_cache() -> TokenIdCache:
    """This process's cache, used by :class:`~hp_trainer.components.data.dataset.TokenizedDataset`.

    Returns:
        The process-wide :class:`TokenIdCache` (its ``limit_bytes`` may be changed; 0 turns
        the cache off).
    """
    return _CACHE
