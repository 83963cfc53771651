"""Offline HF <-> DCP conversion and checkpoint inspection; no process group needed."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from hp_dcp._torch_compat import StoragePrefix as _StoragePrefix
from hp_dcp.huggingface import (
    _plan_shards,
    hf_shard_files,
    iter_hf_tensors,
    parse_size,
    save_hf_safetensors,
)
from hp_dcp.save_load import load
from hp_dcp.storage import FileSystemReader, FileSystemWriter, read_checksums

__all__ = [
    "CheckpointEntry",
    "dcp_to_hf",
    "describe_checkpoint",
    "extract_tensor",
    "format_entries",
    "hf_to_dcp",
    "load_key_map",
]

KeyMap = Callable[[str], "str | None"]


class _Progress(Protocol):
    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


class _PlainProgress:
    """Text progress on stderr for when tqdm is not installed."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done = total, desc, 0

    def update(self, n: int = 1) -> None:
        self.done += n
        print(f"{self.desc}: {self.done}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool) -> _Progress:
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total, desc)
    bar: _Progress = tqdm(total=total, desc=desc, unit="file")
    return bar


def load_key_map(spec: str) -> KeyMap:
    """Import a key-mapping hook given as ``"package.module:function"``.

    Args:
        spec: ``module:attribute``; the attribute is called with each key and returns the new
            key, or ``None`` to drop the tensor.

    Returns:
        The callable.

    Raises:
        ValueError: ``spec`` is malformed or does not name a callable.

    See Also:
        :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter`: TorchTitan's HF key
        mapping.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"key map must look like 'package.module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"{spec!r} does not name a callable")
    return fn  # type: ignore[no-any-return]


def _renames(keys: Iterable[str], key_map: KeyMap | None) -> dict[str, str]:
    """Old key -> new key for each key ``key_map`` keeps; two keys may not share a new name."""
    names: dict[str, str] = {}
    taken: set[str] = set()
    for key in keys:
        new = key_map(key) if key_map is not None else key
        if new is None:
            continue
        if new in taken:
            raise ValueError(f"key map sends two tensors to {new!r} (one of them {key!r})")
        taken.add(new)
        names[key] = new
    return names


def _mapped(tensors: dict[str, torch.Tensor], key_map: KeyMap | None) -> dict[str, torch.Tensor]:
    if key_map is None:
        return tensors
    return {new: tensors[key] for key, new in _renames(tensors, key_map).items()}


def hf_to_dcp(
    hf_path: str | os.PathLike[str],
    dcp_path: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    progress: bool = True,
) -> int:
    """Convert a (sharded) HuggingFace safetensors checkpoint to a DCP checkpoint, offline.

    One safetensors file is in memory at a time; each becomes one ``__0_<i>.distcp`` file of a
    single-rank DCP checkpoint (same crash-safe commit and checksums as :func:`hp_dcp.save`),
    which any world size and layout can then load.

    Args:
        hf_path: the HuggingFace checkpoint directory.
        dcp_path: the DCP checkpoint directory to write.
        key_map: renames each tensor (``None`` drops it), e.g. to add a ``"model."`` prefix.
        progress: show a progress bar (tqdm when installed, else plain lines on stderr).

    Returns:
        The number of tensors written.

    Raises:
        FileNotFoundError: ``hf_path`` holds no safetensors files.
        ValueError: the key map maps two tensors to one name.

    See Also:
        :pt:`torch.distributed.checkpoint.format_utils.torch_save_to_dcp`: PyTorch's offline
        conversion from a :pt:`torch.save` file.
    """
    files = hf_shard_files(hf_path)
    writer = FileSystemWriter(dcp_path)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    state_md: dict[str, Any] = {}
    planner_data: dict[str, Any] = {}
    results: list[list[WriteResult]] = []
    count = 0
    bar = _progress(len(files), "hf -> dcp", progress)
    try:
        for i, (_, tensors) in enumerate(iter_hf_tensors(hf_path)):
            sd: dict[str, Any] = dict(_mapped(tensors, key_map))
            clash = set(sd) & set(state_md)
            if clash:
                raise ValueError(f"tensor names repeated across files: {sorted(clash)[:3]}")
            planner = DefaultSavePlanner()
            planner.set_up_planner(sd, storage_meta=writer.storage_meta(), is_coordinator=True)
            plans, md = planner.create_global_plan([planner.create_local_plan()])
            if i == 0:
                plans = writer.prepare_global_plan(plans)
            plan = planner.finish_plan(
                dataclasses.replace(plans[0], storage_data=_StoragePrefix(f"__0_{i}_"))
            )
            results.append(writer.write_data(plan, planner).value())
            state_md.update(md.state_dict_metadata)
            if isinstance(md.planner_data, dict):
                planner_data.update(md.planner_data)
            count += len(sd)
            bar.update(1)
    finally:
        bar.close()
    writer.finish(Metadata(state_dict_metadata=state_md, planner_data=planner_data), results)
    return count


def dcp_to_hf(
    dcp_path: str | os.PathLike[str],
    hf_path: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
) -> tuple[int, list[str]]:
    """Convert a DCP checkpoint (any world size and layout) to sharded HF safetensors, offline.

    Tensors are gathered one output shard at a time (so peak memory is about one shard);
    non-tensor entries (optimizer hyperparameters and the like) have no place in safetensors
    and are listed in the return value instead of being written.

    Args:
        dcp_path: the DCP checkpoint directory (verified against its checksums when present).
        hf_path: the output directory.
        key_map: renames each tensor (``None`` drops it), e.g. to strip a ``"model."`` prefix.
        max_shard_size: the largest output file, bytes or ``"5GB"``-style text.
        progress: show a progress bar.

    Returns:
        ``(number of tensors written, names of the non-tensor entries skipped)``.

    Raises:
        ValueError: the key map maps two tensors to one name.

    See Also:
        :pt:`torch.distributed.checkpoint.format_utils.dcp_to_torch_save`: PyTorch's offline
        conversion to a :pt:`torch.save` file.
    """
    reader = FileSystemReader(dcp_path)
    metadata = reader.read_metadata()
    stored: dict[str, TensorStorageMetadata] = {}
    skipped: list[str] = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            stored[key] = md
        else:
            skipped.append(key)
    names = _renames(stored, key_map)
    tensors = {key: stored[key] for key in names}
    limit = parse_size(max_shard_size)
    groups = _plan_shards(((k, _nbytes(tensors[k])) for k in tensors), limit)
    out: dict[str, torch.Tensor] = {}
    bar = _progress(len(groups), "dcp -> hf", progress)
    try:
        for group in groups:
            if group:
                out.update(_read_tensors(dcp_path, {k: tensors[k] for k in group}, names))
            bar.update(1)
    finally:
        bar.close()
    save_hf_safetensors(out, hf_path, max_shard_size=limit)
    return len(out), skipped


def _nbytes(md: TensorStorageMetadata) -> int:
    return int(md.size.numel()) * torch.empty((), dtype=md.properties.dtype).element_size()


def _read_tensors(
    dcp_path: str | os.PathLike[str],
    wanted: dict[str, TensorStorageMetadata],
    names: dict[str, str],
) -> dict[str, torch.Tensor]:
    targets: dict[str, Any] = {
        k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in wanted.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ..." is the point here
        load(
            targets,
            checkpoint_id=dcp_path,
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
    return {names[k]: v for k, v in targets.items()}


@dataclasses.dataclass(frozen=True)
class CheckpointEntry:
    """One entry of a DCP checkpoint as listed by :func:`describe_checkpoint`.

    Attributes:
        key: the flattened state-dict key.
        kind: ``"tensor"`` or ``"bytes"`` (a pickled non-tensor value).
        dtype: the tensor dtype (``None`` for bytes).
        shape: the global shape (``None`` for bytes).
        chunks: how many stored chunks make up the tensor (the save-time sharding).
        nbytes: the tensor's size in bytes (``None`` for bytes).
        layout: mesh shape and placements at save time, when hp-dcp recorded them.

    See Also:
        :pt:`torch.distributed.checkpoint.metadata.TensorStorageMetadata`: the DCP record.
    """

    key: str
    kind: str
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    chunks: int
    nbytes: int | None
    layout: dict[str, Any] | None


def describe_checkpoint(path: str | os.PathLike[str]) -> list[CheckpointEntry]:
    """List every entry of a DCP checkpoint (hp-dcp- or torch-written) without loading data.

    Args:
        path: the checkpoint directory.

    Returns:
        One :class:`CheckpointEntry` per key, sorted by key.

    Raises:
        IncompleteCheckpointError: ``path`` is not a committed checkpoint.
        CheckpointCorruptionError: ``.metadata`` fails its checksum.

    See Also:
        :pt:`torch.distributed.checkpoint.FileSystemReader.read_metadata`: the raw metadata.
    """
    metadata = FileSystemReader(path).read_metadata()
    sums = read_checksums(path)
    layouts = sums.get("layouts", {}) if sums is not None else {}
    entries: list[CheckpointEntry] = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, BytesStorageMetadata):
            entries.append(CheckpointEntry(key, "bytes", None, None, 1, None, None))
            continue
        entries.append(
            CheckpointEntry(
                key,
                "tensor",
                md.properties.dtype,
                tuple(md.size),
                len(md.chunks),
                _nbytes(md),
                layouts.get(key),
            )
        )
    return entries


def format_entries(entries: list[CheckpointEntry]) -> Iterator[str]:
    """Format checkpoint entries as the ``hp-dcp inspect`` table.

    Args:
        entries: as returned by :func:`describe_checkpoint`.

    Returns:
        An iterator over the table's lines: a header, then one line per entry (key, kind, dtype,
        global shape, number of stored chunks, save-time layout).

    See Also:
        :pt:`torch.distributed.checkpoint.metadata.Metadata`: the records listed.
    """
    yield f"{'key':<48} {'kind':<6} {'dtype':<10} {'shape':<16} {'chunks':>6}  layout"
    for e in entries:
        dtype = str(e.dtype).removeprefix("torch.") if e.dtype is not None else "-"
        shape = "x".join(map(str, e.shape)) if e.shape is not None else "-"
        if e.layout:
            layout = f"mesh {e.layout['mesh_shape']} {', '.join(e.layout['placements'])}"
        else:
            layout = "-"
        yield f"{e.key:<48} {e.kind:<6} {dtype:<10} {shape or 'scalar':<16} {e.chunks:>6}  {layout}"


def extract_tensor(path: str | os.PathLike[str], key: str) -> torch.Tensor:
    """Read one full tensor out of a DCP checkpoint, offline, whatever its save-time sharding.

    Args:
        path: the checkpoint directory.
        key: the flattened key (as listed by :func:`describe_checkpoint`).

    Returns:
        The full tensor on CPU.

    Raises:
        KeyError: no tensor entry has that key.

    See Also:
        :pt:`torch.distributed.checkpoint.format_utils.dcp_to_torch_save`: converts everything.
    """
    metadata = FileSystemReader(path).read_metadata()
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        raise KeyError(f"{key!r} is not a tensor entry of {Path(path)}")
    return _read_tensors(path, {key: md}, {key: key})[key]
