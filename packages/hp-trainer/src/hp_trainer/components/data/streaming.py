"""Training straight from a streamed HuggingFace ``datasets`` source (``--data.streaming``).

Documents are read with ``datasets.load_dataset(..., streaming=True)``, tokenized as they
arrive and packed into the same fixed-length samples as :class:`~hp_trainer.TokenizedDataset`
(each document framed by BOS/EOS, sample ``i`` the ids ``[i*seq_len, (i+1)*seq_len + 1)`` of the
stream), so no rank holds the corpus, tokenized or not. Each data-parallel rank reads its own
part (``datasets.distributed.split_dataset_by_node``): whole files when their number divides by
the data-parallel degree, else every ``dp``-th record. The loader's state is the ``datasets``
iterator's state plus the packing buffer, so a resumed run continues at the next token.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hp_trainer.components.data.dataset import BUILTIN_DATASETS
from hp_trainer.components.data.prepared import is_prepared_corpus
from hp_trainer.components.tokenizer import HuggingFaceTokenizer

__all__ = ["StreamingSource", "StreamingTextLoader", "check_streaming_source"]

STREAM_STATE_FORMAT = "hp-trainer-stream/1"
"""The ``format`` value of :meth:`StreamingTextLoader.state_dict`."""

# file name ending -> datasets builder (the longest ending is tried first)
_BUILDERS = {
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".txt.gz": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}


def _builder_of(path: Path) -> str | None:
    for ending, builder in _BUILDERS.items():
        if path.name.endswith(ending):
            return builder
    return None


def _import_datasets(what: str) -> Any:
    try:
        # by name: an optional package, whose types the type check must not need
        return importlib.import_module("datasets")
    except ImportError as exc:
        raise ImportError(
            f"{what} needs HuggingFace datasets, which is not installed: "
            "pip install 'hp-trainer[datasets]'"
        ) from exc


class _NoRecordsError(ValueError):
    """A source without a single record."""


@dataclass(frozen=True)
class StreamingSource:
    """Where a streamed dataset comes from: local files of one format, or a hub name.

    Attributes:
        dataset: The name or path as configured.
        builder: The ``datasets`` builder of the local files (``json``, ``parquet``, ``arrow``,
            ``text``), or None for a hub dataset.
        data_files: The local files, in name order (empty for a hub dataset).

    See Also:
        ``datasets.load_dataset``: what the source is opened with.
    """

    dataset: str
    builder: str | None
    data_files: tuple[str, ...]

    @classmethod
    def resolve(cls, dataset: str) -> StreamingSource:
        """Classify a built-in name, a file, a folder of files or a hub name.

        Args:
            dataset: ``data.dataset``.

        Returns:
            The source.

        Raises:
            ValueError: For a path that does not exist (and is no ``org/name`` hub name), a
                file or folder of no supported format, a folder of several formats, or a folder
                prepared by ``hp-train-prepare`` (already tokenized: not streamed).

        See Also:
            ``datasets.load_dataset``: its ``data_files`` argument.
        """
        path = BUILTIN_DATASETS.get(dataset, Path(dataset))
        endings = ", ".join(_BUILDERS)
        if path.is_dir():
            if is_prepared_corpus(path):
                raise ValueError(
                    f"data.dataset {dataset!r} is a prepared (tokenized) corpus: it is read "
                    "through memory maps, not streamed; set --data.streaming false"
                )
            files = sorted(p for p in path.iterdir() if p.is_file() and _builder_of(p))
            if not files:
                raise ValueError(f"the folder {path} holds no {endings} files to stream")
            builders = {str(_builder_of(p)) for p in files}
            if len(builders) > 1:
                raise ValueError(
                    f"the folder {path} mixes file formats ({', '.join(sorted(builders))}): a "
                    "streamed dataset reads one format"
                )
            return cls(dataset, builders.pop(), tuple(str(p) for p in files))
        if path.is_file():
            builder = _builder_of(path)
            if builder is None:
                raise ValueError(f"{path}: a streamed file must end in one of {endings}")
            return cls(dataset, builder, (str(path),))
        if dataset.count("/") == 1 and not dataset.startswith((".", "/", "~")):
            return cls(dataset, None, ())  # a hub name such as "org/dataset"
        raise ValueError(
            f"data.dataset {dataset!r} does not exist: expected a built-in name "
            f"({', '.join(BUILTIN_DATASETS)}), a file or folder ({endings}), or a HuggingFace "
            "hub name like 'org/dataset'"
        )

    def open(self) -> Any:
        """The source as a ``datasets.IterableDataset`` (reads nothing yet).

        Returns:
            The streamed ``train`` split.

        Raises:
            ImportError: Without ``datasets``.
            ValueError: If ``datasets`` cannot open it (offline hub access, unreadable file) or
                it holds no records.

        See Also:
            ``datasets.load_dataset`` with ``streaming=True``.
        """
        datasets = _import_datasets(f"data.streaming (dataset {self.dataset!r})")
        try:
            if self.builder is None:
                return datasets.load_dataset(self.dataset, split="train", streaming=True)
            return datasets.load_dataset(
                self.builder, data_files=list(self.data_files), split="train", streaming=True
            )
        except StopIteration:  # datasets found no record to infer the columns from
            raise _NoRecordsError(f"the dataset {self.dataset!r} holds no records") from None
        except Exception as exc:  # datasets raises many types (hub, fsspec, arrow)
            where = "the HuggingFace hub (offline?)" if self.builder is None else "disk"
            raise ValueError(
                f"could not open the dataset {self.dataset!r} from {where}: {exc}"
            ) from None

    def text_field(self, configured: str) -> str:
        """The record field holding the text: ``text`` for text files, else ``configured``."""
        return "text" if self.builder == "text" else configured


def _first_record(stream: Any, where: str) -> dict[str, Any] | None:
    try:
        return next(iter(stream), None)
    except Exception as exc:  # a damaged file surfaces while reading
        raise ValueError(f"could not read {where}: {exc}") from None


def check_streaming_source(dataset: str, text_field: str = "text") -> StreamingSource:
    """Check a streamed dataset before training: it opens, has records, and has the field.

    Reads the first record of every local file (the first of a hub dataset), so a missing file,
    an absent text field or an empty dataset is reported before any process starts.

    Args:
        dataset: ``data.dataset``.
        text_field: ``data.jsonl_text_field`` (text files always use ``text``).

    Returns:
        The source.

    Raises:
        ImportError: Without ``datasets``.
        ValueError: Naming the file (or dataset) and the field.

    See Also:
        :titan:`torchtitan.hf_datasets.text_datasets`: TorchTitan meets these errors in every rank.
    """
    source = StreamingSource.resolve(dataset)
    field = source.text_field(text_field)
    files = source.data_files
    parts = [StreamingSource(f, source.builder, (f,)) for f in files] if files else [source]
    found = False
    for part in parts:
        try:
            record = _first_record(part.open(), part.dataset)
        except _NoRecordsError:
            continue  # an empty file among others
        if record is None:
            continue
        found = True
        if field not in record:
            raise ValueError(
                f"{part.dataset}: its records have no field {field!r} (fields: "
                f"{', '.join(record)}); set --data.jsonl_text_field"
            )
    if not found:
        raise ValueError(f"the dataset {dataset!r} holds no records")
    return source


class StreamingTextLoader:
    """Infinite loader of ``(inputs, labels)`` micro-batches packed from a streamed dataset.

    Rank ``r`` of ``dp`` reads its part of the source (``split_dataset_by_node``), tokenizes
    each document as it arrives (framed by BOS/EOS) and cuts its own token stream into samples
    of ``seq_len + 1`` ids overlapping by one (inputs, labels shifted by one), exactly as
    :class:`~hp_trainer.TokenizedDataset` cuts a whole corpus. At the end of its part a rank
    starts the next epoch, packing on across the boundary. Only the unconsumed tail of the
    current documents is held.

    Args:
        dataset: A built-in name, a ``.jsonl``/``.json``/``.parquet``/``.arrow``/``.txt`` file
            (JSON and text optionally ``.gz``), a folder of one such format, or a hub name.
        tokenizer: Tokenizer framing each document by BOS/EOS.
        seq_len: Tokens per sample.
        dp_rank: This rank's data-parallel index.
        dp_world_size: Data-parallel degree.
        batch_size: Samples per micro-batch on this rank.
        text_field: Keyword-only; the record field holding the text (``text`` for text files).
        dp_group: Keyword-only; the data-parallel process group; :meth:`state_dict` gathers the
            ranks' positions over it (None: the default group when initialized).

    Raises:
        ValueError: For a source that cannot be streamed (see
            :class:`~hp_trainer.components.data.streaming.StreamingSource`), or a rank out of range.

    See Also:
        :titan:`torchtitan.hf_datasets.text_datasets.HuggingFaceTextDataset`: TorchTitan's streamed
        packing; ``datasets.distributed.split_dataset_by_node``.
    """

    def __init__(
        self,
        dataset: str,
        tokenizer: HuggingFaceTokenizer,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        batch_size: int,
        *,
        text_field: str = "text",
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_world_size})")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len {seq_len} and batch_size {batch_size} must be >= 1")
        self.source = StreamingSource.resolve(dataset)
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.batch_size = batch_size
        self.text_field = self.source.text_field(text_field)
        self.dp_group = dp_group
        self.epoch = 0
        """Passes over this rank's part started before the current one."""
        self.documents_read = 0
        """Records read by this rank in the current epoch."""
        self._buffer: list[int] = []  # tokens from the next sample's first id on
        self._stream = self._open(None)
        self._records: Iterator[dict[str, Any]] | None = None  # None: no record read since open
        self._opened_at: dict[str, Any] | None = None  # the iterator state the stream opened at
        self._epoch_had_text = False  # whether this epoch gave a document yet

    def _open(self, state: dict[str, Any] | None) -> Any:
        stream = self.source.open()
        if self.dp_world_size > 1:
            split = importlib.import_module("datasets.distributed").split_dataset_by_node
            stream = split(stream, rank=self.dp_rank, world_size=self.dp_world_size)
        if state is not None:
            stream.load_state_dict(state)
        return stream

    def _next_document(self) -> list[int]:
        while True:
            if self._records is None:
                self._records = iter(self._stream)
            record = next(self._records, None)
            if record is None:  # this rank's part is exhausted: the next epoch
                if not self._epoch_had_text:
                    raise ValueError(
                        f"the streamed dataset {self.source.dataset!r} gave data-parallel rank "
                        f"{self.dp_rank} of {self.dp_world_size} no documents"
                    )
                self._epoch_had_text = False
                self.epoch += 1
                self.documents_read = 0
                self._stream = self._open(None)
                self._records = None
                self._opened_at = None
                continue
            self.documents_read += 1
            if self.text_field not in record:
                raise ValueError(
                    f"{self.source.dataset}: record {self.documents_read} of data-parallel rank "
                    f"{self.dp_rank} has no field {self.text_field!r} (fields: "
                    f"{', '.join(record)})"
                )
            text = str(record[self.text_field])
            if self.source.builder == "text" and not text.strip():
                continue  # a blank line is no document (as in hp_trainer.load_documents)
            self._epoch_had_text = True
            return self.tokenizer.encode(text, add_bos=True, add_eos=True)

    def _next_sample(self) -> torch.Tensor:
        while len(self._buffer) < self.seq_len + 1:
            self._buffer.extend(self._next_document())
        window = torch.tensor(self._buffer[: self.seq_len + 1], dtype=torch.long)
        del self._buffer[: self.seq_len]  # the last label is the next sample's first input
        return window

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            windows = torch.stack([self._next_sample() for _ in range(self.batch_size)])
            yield windows[:, :-1], windows[:, 1:]

    def close(self) -> None:
        """Stop reading (the ``datasets`` readers' files close now, not at interpreter exit).

        The position is kept: iterating again continues at the next token.

        See Also:
            ``generator.close``: what ends the ``datasets`` iterator.
        """
        if self._records is None:
            return
        position = self._stream.state_dict()
        close = getattr(self._records, "close", None)
        if close is not None:
            close()
        self._records = None
        self._opened_at = position
        self._stream = self._open(position)

    def _local_state(self) -> str:
        stream = self._opened_at if self._records is None else self._stream.state_dict()
        return json.dumps(
            {
                "epoch": self.epoch,
                "documents_read": self.documents_read,
                "stream": stream,
                "buffer": self._buffer,
            }
        )

    def state_dict(self) -> dict[str, Any]:
        """Every data-parallel rank's position (the same dictionary on every rank).

        Gathers the ranks' positions over the data-parallel group (a collective: call it on
        every rank, as checkpointing does), so the checkpoint stores one copy.

        Returns:
            ``{"format", "dp_world_size", "ranks"}``: ``ranks`` is a JSON list holding, per
            data-parallel rank, its epoch, the ``datasets`` iterator state and the packing
            buffer.

        See Also:
            ``datasets.IterableDataset.state_dict``;
            ``torchdata.stateful_dataloader.StatefulDataLoader.state_dict``.
        """
        mine = self._local_state()
        ranks = [mine]
        if self.dp_world_size > 1:
            ranks = [""] * self.dp_world_size
            dist.all_gather_object(ranks, mine, group=self.dp_group)
        return {
            "format": STREAM_STATE_FORMAT,
            "dp_world_size": self.dp_world_size,
            "ranks": json.dumps([json.loads(r) for r in ranks]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the next token of a saved run, at the same data-parallel degree.

        A rank's position only exists in the part of the source that rank read, so a state
        saved at another data-parallel degree is refused.

        Args:
            state: A dictionary from :meth:`state_dict`.

        Raises:
            ValueError: If ``state`` is not a streamed loader's state, or was saved at another
                data-parallel degree (the message names both).

        See Also:
            ``datasets.IterableDataset.load_state_dict``.
        """
        if not isinstance(state, dict) or state.get("format") != STREAM_STATE_FORMAT:
            raise ValueError(
                "the checkpoint's data loader state is not a streamed loader's (format "
                f"{STREAM_STATE_FORMAT!r}): resume with the data.streaming setting it was saved "
                "with"
            )
        saved = int(state["dp_world_size"])
        if saved != self.dp_world_size:
            raise ValueError(
                f"the streamed data loader state was saved at data-parallel degree {saved}, "
                f"this run has data-parallel degree {self.dp_world_size}: each rank's position "
                "exists only in its own part of the stream, so resume at degree "
                f"{saved} (or start the data afresh: checkpoint.exclude_from_loading "
                "['dataloader'])"
            )
        mine = json.loads(state["ranks"])[self.dp_rank]
        self.epoch = int(mine["epoch"])
        self.documents_read = int(mine["documents_read"])
        self._epoch_had_text = self.documents_read > 0
        self._buffer = [int(t) for t in mine["buffer"]]
        self._opened_at = mine["stream"]
        self._stream = self._open(self._opened_at)
        self._records = None
