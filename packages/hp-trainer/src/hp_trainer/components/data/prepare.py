"""``hp-train-prepare``: tokenize a corpus once, in parallel, into a prepared folder.

Reads text files (``.txt``: one document per line; ``.jsonl``: one JSON object per line, the
text under ``--text-field``; both optionally ``.gz``) or folders of them, and, through
HuggingFace ``datasets`` (the optional extra ``hp-trainer[datasets]``), local ``.parquet``,
``.arrow`` and ``.json`` files and hub names (``org/name``; without a network they fail with a
clear message), streamed; encodes batches of
documents in worker processes (each loads the tokenizer once), and writes the shards and
``index.json`` of :mod:`hp_trainer.components.data.prepared` in document order, so the output
does not depend
on the number of workers. Memory stays bounded: at most ``2 x workers`` batches are in flight.
"""

from __future__ import annotations

import argparse
import array
import gzip
import importlib
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from hp_trainer.components.data.prepared import INDEX_FILE, PREPARED_FORMAT
from hp_trainer.components.tokenizer import HuggingFaceTokenizer

__all__ = ["PrepareOptions", "main", "prepare_corpus"]

_TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz")


@dataclass(frozen=True)
class PrepareOptions:
    """What ``prepare_corpus()`` reads and how it writes.

    Attributes:
        inputs: Text/JSONL files or folders of them.
        output: The folder to write (created; must not hold a prepared corpus already).
        tokenizer_path: ``tokenizer.json`` or its folder (``builtin``: the shipped one).
        text_field: JSONL field holding the text.
        bos_token: BOS text overriding the tokenizer's config files.
        eos_token: EOS text overriding the tokenizer's config files.
        workers: Tokenizing processes (0: one per CPU, at most 8).
        batch_documents: Documents per batch sent to a worker.
        shard_tokens: Tokens per shard file (a shard ends at a document boundary past it).
        progress: Print a progress line to stderr.
    """

    inputs: tuple[str, ...]
    output: str
    tokenizer_path: str = "builtin"
    text_field: str = "text"
    bos_token: str | None = None
    eos_token: str | None = None
    workers: int = 0
    batch_documents: int = 512
    shard_tokens: int = 256 * 1024 * 1024
    progress: bool = True


# read through HuggingFace ``datasets`` (the optional extra): builder name by file suffix
_DATASETS_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json"}


@dataclass(frozen=True)
class _Source:
    """One input: a text/JSONL file read here, or a ``datasets`` source (file, folder, hub)."""

    name: str
    path: Path | None  # a local text/JSONL file, else None
    builder: str | None = None  # datasets builder for local files ("parquet", ...), None: hub


def _sources(inputs: tuple[str, ...]) -> list[_Source]:
    sources: list[_Source] = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            text = sorted(p for p in path.iterdir() if p.name.endswith(_TEXT_SUFFIXES))
            other = sorted(p for p in path.iterdir() if p.suffix in _DATASETS_BUILDERS)
            if not text and not other:
                suffixes = [*_TEXT_SUFFIXES, *_DATASETS_BUILDERS]
                raise ValueError(f"the folder {path} holds no {'/'.join(suffixes)} files")
            sources += [_Source(str(p), p) for p in text]
            sources += [_Source(str(p), None, _DATASETS_BUILDERS[p.suffix]) for p in other]
        elif path.is_file():
            if path.name.endswith(_TEXT_SUFFIXES):
                sources.append(_Source(name, path))
            elif path.suffix in _DATASETS_BUILDERS:
                sources.append(_Source(name, None, _DATASETS_BUILDERS[path.suffix]))
            else:
                suffixes = [*_TEXT_SUFFIXES, *_DATASETS_BUILDERS]
                raise ValueError(f"{path}: expected a file ending in {', '.join(suffixes)}")
        elif "/" in name and not name.startswith((".", "/")) and name.count("/") == 1:
            sources.append(_Source(name, None))  # a hub name such as "org/dataset"
        else:
            raise ValueError(
                f"corpus input {name!r} does not exist (and is not a HuggingFace hub name "
                "like 'org/dataset')"
            )
    return sources


def _import_datasets(source: str) -> Any:
    try:
        # by name: an optional package, whose types the type check must not need
        datasets = importlib.import_module("datasets")
    except ImportError as exc:
        raise ImportError(
            f"reading {source} needs HuggingFace datasets: pip install 'hp-trainer[datasets]'"
        ) from exc
    return datasets


def _dataset_records(source: _Source) -> Iterator[Any]:
    datasets = _import_datasets(source.name)
    try:
        if source.builder is not None:
            data = datasets.load_dataset(
                source.builder, data_files=source.name, split="train", streaming=True
            )
        else:
            data = datasets.load_dataset(source.name, split="train", streaming=True)
        yield from data
    except (OSError, ConnectionError, ValueError) as exc:
        where = "the HuggingFace hub (offline?)" if source.builder is None else "disk"
        raise ValueError(
            f"could not read the dataset {source.name!r} from {where}: {exc}"
        ) from None


def _documents(sources: list[_Source], text_field: str, progress: _Progress) -> Iterator[str]:
    for source in sources:
        if source.path is None:
            for number, record in enumerate(_dataset_records(source), 1):
                if text_field not in record:
                    raise ValueError(
                        f"{source.name}: record {number} has no field {text_field!r} "
                        f"(fields: {', '.join(record)})"
                    )
                text = str(record[text_field])
                progress.bytes_read += len(text)
                if text.strip():
                    yield text
            continue
        path = source.path
        opener: Any = gzip.open if path.name.endswith(".gz") else open
        is_jsonl = ".jsonl" in path.name
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                progress.bytes_read += len(line)
                if not line.strip():
                    continue
                if not is_jsonl:
                    yield line.rstrip("\n")
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not a JSON object: {exc}") from None
                if not isinstance(record, dict) or text_field not in record:
                    raise ValueError(f"{path}:{lineno}: JSON record has no field {text_field!r}")
                yield str(record[text_field])


def _batches(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class _Progress:
    """Bytes read of the input, documents and tokens written, printed at most twice a second."""

    def __init__(self, total_bytes: int, enabled: bool, stream: TextIO) -> None:
        self.total_bytes = max(total_bytes, 1)
        self.enabled = enabled
        self.stream = stream
        self.bytes_read = 0
        self.documents = 0
        self.tokens = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, final: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not final and now - self._last < 0.5):
            return
        self._last = now
        # gzip inputs count uncompressed characters: cap the bar at 100 %
        fraction = min(self.bytes_read / self.total_bytes, 1.0) if not final else 1.0
        filled = round(fraction * 30)
        rate = self.tokens / max(now - self.start, 1e-9)
        self.stream.write(
            f"\r[{'#' * filled}{'-' * (30 - filled)}] {fraction * 100:5.1f}%  "
            f"{self.documents:,} documents  {self.tokens:,} tokens  {rate:,.0f} tokens/s"
            + ("\n" if final else "")
        )
        self.stream.flush()


_WORKER_TOKENIZER: HuggingFaceTokenizer | None = None


def _init_worker(tokenizer_path: str, bos: str | None, eos: str | None) -> None:
    global _WORKER_TOKENIZER  # one tokenizer per worker process, loaded once
    _WORKER_TOKENIZER = HuggingFaceTokenizer(tokenizer_path, bos_token=bos, eos_token=eos)


def _encode(batch: list[str]) -> tuple[bytes, list[int]]:
    assert _WORKER_TOKENIZER is not None
    encoded = _WORKER_TOKENIZER.encode_batch(batch)
    ids = array.array("i" if _WORKER_TOKENIZER.vocab_size > 65536 else "H")
    for doc in encoded:
        ids.extend(doc)
    if sys.byteorder != "little":  # pragma: no cover - the files are little-endian
        ids.byteswap()
    return ids.tobytes(), [len(doc) for doc in encoded]


def _to_bytes(tensor: torch.Tensor) -> bytes:
    # little-endian raw values; untyped storage bytes avoid a numpy dependency
    return bytes(tensor.contiguous().untyped_storage())


class _ShardWriter:
    def __init__(self, folder: Path, dtype: str, shard_tokens: int) -> None:
        self.folder = folder
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._tokens: Any = None
        self._docs: Any = None

    def _open(self) -> None:
        n = len(self.shards)
        shard: dict[str, Any] = {
            "tokens_file": f"tokens-{n:05d}.bin",
            "docs_file": f"docs-{n:05d}.bin",
            "num_tokens": 0,
            "num_documents": 0,
        }
        self.shards.append(shard)
        self._tokens = open(self.folder / shard["tokens_file"], "wb")  # noqa: SIM115
        self._docs = open(self.folder / shard["docs_file"], "wb")  # noqa: SIM115

    def write(self, data: bytes, lengths: list[int]) -> None:
        if self._tokens is None:
            self._open()
        shard = self.shards[-1]
        offsets = []
        pos = shard["num_tokens"]
        for length in lengths:
            offsets.append(pos)
            pos += length
        self._tokens.write(data)
        self._docs.write(_to_bytes(torch.tensor(offsets, dtype=torch.int64)))
        shard["num_tokens"] = pos
        shard["num_documents"] += len(lengths)
        if pos >= self.shard_tokens:
            self.close()

    def close(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
            self._docs.close()
            self._tokens = self._docs = None


def prepare_corpus(options: PrepareOptions, *, stream: TextIO | None = None) -> dict[str, Any]:
    """Tokenize the inputs into a prepared corpus folder.

    Args:
        options: What to read and where to write.
        stream: Keyword-only; where progress goes (default ``sys.stderr``).

    Returns:
        The ``index.json`` written.

    Raises:
        ValueError: For a missing or empty input, a JSONL record without the text field, an
            output folder that already holds a prepared corpus, or a tokenizer without BOS/EOS.

    See Also:
        :titan:`torchtitan.hf_datasets`: TorchTitan tokenizes on the fly instead.
    """
    sources = _sources(options.inputs)
    if any(source.path is None for source in sources):
        _import_datasets(", ".join(s.name for s in sources if s.path is None))
    out = Path(options.output)
    if (out / INDEX_FILE).exists():
        raise ValueError(f"{out} already holds a prepared corpus; choose another --output")
    tokenizer = HuggingFaceTokenizer(
        options.tokenizer_path, bos_token=options.bos_token, eos_token=options.eos_token
    )
    out.mkdir(parents=True, exist_ok=True)
    dtype = "int32" if tokenizer.vocab_size > 65536 else "uint16"
    writer = _ShardWriter(out, dtype, options.shard_tokens)
    progress = _Progress(
        sum(Path(s.name).stat().st_size for s in sources if Path(s.name).is_file()),
        options.progress,
        stream or sys.stderr,
    )
    workers = options.workers or min(os.cpu_count() or 1, 8)
    batches = _batches(_documents(sources, options.text_field, progress), options.batch_documents)
    # fork: a worker starts in milliseconds (spawn would import torch in each); nothing here
    # has started threads yet (the tokenizer has not encoded anything in this process)
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    init_args = (str(tokenizer.path), options.bos_token, options.eos_token)
    with context.Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        pending: deque[Any] = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode, (batch,)))
            while len(pending) >= 2 * workers:
                _write(writer, progress, pending.popleft().get())
        while pending:
            _write(writer, progress, pending.popleft().get())
    writer.close()
    progress.update(final=True)
    if progress.documents == 0:
        raise ValueError(f"the corpus {', '.join(options.inputs)} holds no documents")
    index = {
        "format": PREPARED_FORMAT,
        "dtype": dtype,
        "tokenizer": str(tokenizer.path),
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "num_tokens": progress.tokens,
        "num_documents": progress.documents,
        "inputs": [s.name for s in sources],
        "shards": writer.shards,
    }
    tmp = out / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    tmp.replace(out / INDEX_FILE)  # the index appears last: a folder with it is complete
    return index


def _write(writer: _ShardWriter, progress: _Progress, result: tuple[bytes, list[int]]) -> None:
    data, lengths = result
    writer.write(data, lengths)
    progress.documents += len(lengths)
    progress.tokens += sum(lengths)
    progress.update()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hp-train-prepare``.

    Args:
        argv: Arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit status (2 for bad input, named in the message).

    See Also:
        :titan:`torchtitan`'s data preparation is external; this mirrors Megatron's
        ``preprocess_data.py`` workflow.
    """
    parser = argparse.ArgumentParser(
        prog="hp-train-prepare",
        description="Tokenize a corpus once into memory-mapped shards for hp-train "
        "(then: hp-train --data.dataset OUTPUT).",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        help=".txt/.jsonl files (optionally .gz), folders of them; with the datasets extra also "
        ".parquet/.arrow/.json files and hub names (org/name)",
    )
    parser.add_argument("--output", "-o", required=True, help="folder to write")
    parser.add_argument("--tokenizer", default="builtin", help="tokenizer.json or its folder")
    parser.add_argument("--text-field", default="text", help="JSONL field holding the text")
    parser.add_argument("--bos-token", default=None, help="BOS text (default: tokenizer config)")
    parser.add_argument("--eos-token", default=None, help="EOS text (default: tokenizer config)")
    parser.add_argument("--workers", type=int, default=0, help="processes (0: one per CPU)")
    parser.add_argument("--shard-tokens", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.workers < 0 or args.shard_tokens < 1:
        parser.error("--workers must be >= 0 and --shard-tokens >= 1")
    options = PrepareOptions(
        inputs=tuple(args.inputs),
        output=args.output,
        tokenizer_path=args.tokenizer,
        text_field=args.text_field,
        bos_token=args.bos_token,
        eos_token=args.eos_token,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
        progress=not args.quiet,
    )
    try:
        index = prepare_corpus(options)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"hp-train-prepare: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"hp-train-prepare: {index['num_documents']:,} documents, {index['num_tokens']:,} tokens "
        f"in {len(index['shards'])} shard(s) at {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
