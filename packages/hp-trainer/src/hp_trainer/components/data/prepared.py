"""Pre-tokenized corpora: memory-mapped token shards plus an index, read a window at a time.

``hp-train-prepare`` (:mod:`hp_trainer.components.data.prepare`) writes a folder::

    index.json            format, dtype, tokenizer, BOS/EOS ids, and per shard its files,
                          token and document counts
    tokens-00000.bin      the token ids of whole documents (each framed by BOS/EOS), raw
                          little-endian uint16 (vocabularies up to 65536) or int32
    docs-00000.bin        int64 offset of each document's first token in its shard

Training maps the shards (``mmap``) and copies only the ``seq_len + 1`` ids of each sample it
draws, so a rank's memory holds the windows of its own samples, not the corpus, and opening a
corpus costs the same whatever its size.
"""

from __future__ import annotations

import bisect
import json
import mmap
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["PREPARED_FORMAT", "PreparedShard", "PreparedTokenDataset", "is_prepared_corpus"]

PREPARED_FORMAT = "hp-trainer-tokens/1"
"""The ``format`` value in ``index.json`` of a prepared corpus."""

INDEX_FILE = "index.json"
_DTYPES = {"uint16": torch.uint16, "int32": torch.int32}
_ITEM_SIZE = {"uint16": 2, "int32": 4}


def is_prepared_corpus(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by ``hp-train-prepare``.

    Args:
        path: A dataset path.

    Returns:
        True when it holds an ``index.json``.

    See Also:
        :titan:`torchtitan.hf_datasets`: TorchTitan streams raw text instead.
    """
    return (Path(path) / INDEX_FILE).is_file()


@dataclass(frozen=True)
class PreparedShard:
    """One shard of a prepared corpus.

    Attributes:
        tokens_file: File of the token ids.
        docs_file: File of the documents' first-token offsets.
        num_tokens: Token ids in the shard.
        num_documents: Documents in the shard.
    """

    tokens_file: str
    docs_file: str
    num_tokens: int
    num_documents: int


def read_index(folder: str | Path) -> dict[str, Any]:
    """Read and check ``index.json`` of a prepared corpus.

    Args:
        folder: The corpus folder.

    Returns:
        The index.

    Raises:
        ValueError: If the index is not of this format or a shard file is missing or short.

    See Also:
        ``is_prepared_corpus``.
    """
    root = Path(folder)
    file = root / INDEX_FILE
    try:
        index = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != PREPARED_FORMAT:
        raise ValueError(f"{file} is not an index of format {PREPARED_FORMAT!r}")
    dtype = index.get("dtype")
    if dtype not in _DTYPES:
        raise ValueError(f"{file}: dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    for shard in index["shards"]:
        for key, size in (
            ("tokens_file", shard["num_tokens"] * _ITEM_SIZE[dtype]),
            ("docs_file", shard["num_documents"] * 8),
        ):
            path = root / shard[key]
            if not path.is_file() or path.stat().st_size != size:
                raise ValueError(
                    f"prepared corpus {root}: {path.name} is missing or not {size} bytes "
                    "(an interrupted hp-train-prepare? prepare it again)"
                )
    return index


class PreparedTokenDataset:
    """Fixed-length next-token samples over a prepared corpus, read through memory maps.

    The shards are one token stream; sample ``i`` is ``stream[i*seq_len : (i+1)*seq_len + 1]``
    (the same samples :class:`~hp_trainer.TokenizedDataset` cuts from the same documents), so
    :class:`~hp_trainer.ParallelAwareDataloader` shards, shuffles and resumes it unchanged.

    Args:
        folder: A folder written by ``hp-train-prepare``.
        seq_len: Tokens per sample.

    Raises:
        ValueError: For a damaged corpus, or one shorter than one sample.

    See Also:
        :titan:`torchtitan.hf_datasets.text_datasets.HuggingFaceTextDataset`: TorchTitan's packing.
    """

    def __init__(self, folder: str | Path, seq_len: int) -> None:
        self.folder = Path(folder)
        self.index = read_index(self.folder)
        self.seq_len = seq_len
        self.dtype = _DTYPES[self.index["dtype"]]
        self.item_size = _ITEM_SIZE[self.index["dtype"]]
        self.shards = [
            PreparedShard(s["tokens_file"], s["docs_file"], s["num_tokens"], s["num_documents"])
            for s in self.index["shards"]
        ]
        self.shard_starts: list[int] = []
        total = 0
        for shard in self.shards:
            self.shard_starts.append(total)
            total += shard.num_tokens
        self.num_tokens = total
        self.num_samples = (total - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"the prepared corpus {self.folder} has {total} tokens: too few for one sample "
                f"of seq_len {seq_len}"
            )
        self._maps: dict[int, mmap.mmap] = {}

    @property
    def bos_id(self) -> int | None:
        """The BOS id the corpus was prepared with."""
        value = self.index.get("bos_id")
        return None if value is None else int(value)

    @property
    def eos_id(self) -> int | None:
        """The EOS id the corpus was prepared with."""
        value = self.index.get("eos_id")
        return None if value is None else int(value)

    @property
    def vocab_size(self) -> int:
        """The vocabulary size of the tokenizer it was prepared with."""
        return int(self.index["vocab_size"])

    def __len__(self) -> int:
        return self.num_samples

    def _map(self, shard: int) -> mmap.mmap:
        if shard not in self._maps:
            with open(self.folder / self.shards[shard].tokens_file, "rb") as f:
                # copy-on-write: a writable buffer for torch.frombuffer, pages read on demand
                self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[shard]

    def tokens(self, start: int, stop: int) -> torch.Tensor:
        """Token ids ``[start, stop)`` of the stream (int64, a copy).

        Args:
            start: First position.
            stop: One past the last position.

        Returns:
            ``(stop - start,)`` int64 ids.

        See Also:
            ``numpy.memmap``: the same idea, without numpy.
        """
        pieces = []
        shard = bisect.bisect_right(self.shard_starts, start) - 1
        pos = start
        while pos < stop:
            local = pos - self.shard_starts[shard]
            count = min(stop - pos, self.shards[shard].num_tokens - local)
            view = torch.frombuffer(
                self._map(shard), dtype=self.dtype, count=count, offset=local * self.item_size
            )
            if sys.byteorder != "little":  # pragma: no cover - files are little-endian
                view = view.byteswap()  # type: ignore[attr-defined]
            pieces.append(view.to(torch.long))
            pos += count
            shard += 1
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs, labels)`` of one sample.

        Args:
            index: Sample index in ``[0, len(self))``.

        Returns:
            Two ``(seq_len,)`` int64 tensors.

        See Also:
            :pt:`torch.utils.data.Dataset.__getitem__`.
        """
        start = index * self.seq_len
        window = self.tokens(start, start + self.seq_len + 1)
        return window[:-1], window[1:]

    def close(self) -> None:
        """Unmap the shards (they are mapped again on the next read)."""
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
