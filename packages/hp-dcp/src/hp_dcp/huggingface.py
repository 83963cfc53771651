"""HuggingFace safetensors checkpoints: sharded ``model-0000x-of-0000y.safetensors`` + index."""

from __future__ import annotations

import json
import mmap
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hp_dcp._checksum import crc32
from hp_dcp._files import check_member_name, fsync_dir, open_member, parse_json, read_member
from hp_dcp.errors import CheckpointCorruptionError, UnverifiedCheckpointWarning

__all__ = [
    "HF_INDEX_FILE",
    "HFCheckpointFiles",
    "hf_shard_files",
    "iter_hf_tensors",
    "load_hf_safetensors",
    "parse_size",
    "save_hf_safetensors",
    "save_hf_shard_file",
    "write_hf_index",
]

HF_INDEX_FILE = "model.safetensors.index.json"
"""Name of the index json mapping each tensor to its shard file."""

_CHECKSUMS_KEY = "hp_dcp_checksums"
# Also in every file's safetensors header: deleting the index cannot turn verification off.
_HEADER_MARKER = {_CHECKSUMS_KEY: "crc32 in " + HF_INDEX_FILE}
_MAX_INDEX_BYTES = 1 << 28

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Parse a shard size such as ``"5GB"``, ``"500MiB"`` or ``1000000`` into bytes.

    Args:
        size: bytes as an int, or a number with a unit (B, KB, MB, GB, TB, KiB, ..., TiB).

    Returns:
        The size in bytes.

    Raises:
        ValueError: the size is not positive or not understood.

    See Also:
        ``transformers.modeling_utils.PreTrainedModel.save_pretrained``: HF's ``max_shard_size``.
    """
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE.match(str(size))
        if m is None:
            raise ValueError(f"max_shard_size must look like '5GB' or an int, got {size!r}")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _plan_shards(sizes: Iterable[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for key, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += nbytes
    return shards


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def save_hf_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
) -> list[str]:
    """Write a full state dict as sharded safetensors files plus ``model.safetensors.index.json``.

    Tensors are written in key order into shards of at most ``max_shard_size`` bytes (a larger
    tensor gets a shard of its own). Each file is written under a temporary name, fsynced and
    renamed, the index last, so readers never see a half-written file. The index records the
    size and CRC-32 of every file (``metadata.hp_dcp_checksums``) and every file's header says
    so, so :func:`load_hf_safetensors` verifies them and refuses the files if the index is
    lost. Other files in ``path`` (``config.json`` and the like) are left alone.

    Args:
        state_dict: tensor name -> tensor (non-contiguous and non-CPU tensors are copied).
        path: the output directory (created if missing).
        max_shard_size: the largest shard, in bytes or as ``"5GB"``-style text.
        metadata: string metadata stored in every file's header (``format`` defaults to "pt").

    Returns:
        The shard file names, in order.

    Raises:
        TypeError: a value is not a tensor.
        ValueError: ``max_shard_size`` is invalid.

    See Also:
        :pt:`torch.distributed.checkpoint.HuggingFaceStorageWriter`: PyTorch's DCP-driven writer.
    """
    limit = parse_size(max_shard_size)
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"safetensors holds tensors only; {key!r} is a {type(value).__name__}")
    keys = sorted(state_dict)
    shards = _plan_shards(((k, state_dict[k].nbytes) for k in keys), limit)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {}), **_HEADER_MARKER}
    names: list[str] = []
    weight_map: dict[str, str] = {}
    sums: dict[str, dict[str, int]] = {}
    for i, shard in enumerate(shards):
        name = _shard_name(i, len(shards))
        tensors = {k: state_dict[k].detach().cpu().contiguous() for k in shard}
        tmp = out / f".{name}.tmp"
        save_file(tensors, str(tmp), metadata=meta)
        sums[name] = _sync_and_sum(tmp)
        os.replace(tmp, out / name)
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    index = {
        "metadata": {
            "total_size": sum(state_dict[k].nbytes for k in keys),
            _CHECKSUMS_KEY: {"algorithm": "crc32", "files": sums},
        },
        "weight_map": weight_map,
    }
    tmp_index = out / f".{HF_INDEX_FILE}.tmp"
    with tmp_index.open("w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_index, out / HF_INDEX_FILE)
    fsync_dir(out)
    return names


def save_hf_shard_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    name: str,
    *,
    metadata: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """Write one safetensors file of a sharded HF checkpoint (for writers that share the work).

    The file is written under a temporary name, fsynced and renamed, and its header carries the
    same marker as :func:`save_hf_safetensors` writes, so the file is refused unless an index
    written by :func:`write_hf_index` records its checksum.

    Args:
        tensors: tensor name -> tensor (copied to contiguous CPU tensors).
        path: the checkpoint directory (created if missing).
        name: the file name inside ``path``.
        metadata: string metadata for the header (``format`` defaults to "pt").

    Returns:
        The file's ``{"size": ..., "crc32": ...}`` entry for :func:`write_hf_index`.

    Raises:
        UnsafeCheckpointError: ``name`` is not a plain file name.

    See Also:
        :pt:`torch.distributed.checkpoint.HuggingFaceStorageWriter`: PyTorch's DCP-driven writer.
    """
    out = Path(path)
    check_member_name(name, str(out))
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {}), **_HEADER_MARKER}
    tmp = out / f".{name}.tmp"
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), meta)
    sums = _sync_and_sum(tmp)
    os.replace(tmp, out / name)
    return sums


def write_hf_index(
    path: str | os.PathLike[str],
    weight_map: Mapping[str, str],
    sums: Mapping[str, Mapping[str, int]],
    total_size: int,
) -> None:
    """Write ``model.safetensors.index.json`` (with checksums) for files already written.

    Args:
        path: the checkpoint directory.
        weight_map: tensor name -> file name.
        sums: file name -> the entry :func:`save_hf_shard_file` returned.
        total_size: bytes of all tensors.

    Raises:
        ValueError: a file of ``weight_map`` has no checksum entry.

    See Also:
        :pt:`torch.distributed.checkpoint.HuggingFaceStorageWriter`: PyTorch's DCP-driven writer.
    """
    missing = sorted(set(weight_map.values()) - set(sums))
    if missing:
        raise ValueError(f"write_hf_index: no checksum for {missing}")
    out = Path(path)
    index = {
        "metadata": {
            "total_size": total_size,
            _CHECKSUMS_KEY: {"algorithm": "crc32", "files": {k: dict(v) for k, v in sums.items()}},
        },
        "weight_map": dict(weight_map),
    }
    tmp_index = out / f".{HF_INDEX_FILE}.tmp"
    with tmp_index.open("w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_index, out / HF_INDEX_FILE)
    fsync_dir(out)


def _sync_and_sum(path: Path) -> dict[str, int]:
    """fsync a written file and return its size and CRC-32."""
    with path.open("rb+") as f:
        os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return {"size": 0, "crc32": crc32(b"")}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return {"size": size, "crc32": crc32(view)}
            finally:
                view.release()


class HFCheckpointFiles:
    """The files of one HF checkpoint directory, their tensors and (if recorded) checksums.

    Args:
        root: the checkpoint directory (index names are confined to it).

    See Also:
        :pt:`torch.distributed.checkpoint.HuggingFaceStorageReader`: PyTorch's DCP-driven reader.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, list[str]] = {}
        self.sums: dict[str, dict[str, int]] | None = None
        index = root / HF_INDEX_FILE
        if index.exists() or index.is_symlink():
            self._read_index(index)
        else:
            for file in sorted(root.glob("*.safetensors")):
                self.files[file.name] = self.header(file.name)[0]
        if not self.files:
            raise FileNotFoundError(f"no safetensors files in {root}")

    def _read_index(self, index: Path) -> None:
        data = parse_json(
            read_member(self.root, HF_INDEX_FILE, str(index), _MAX_INDEX_BYTES), str(index)
        )
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointCorruptionError(f"{index} has no weight_map object")
        for key, name in weight_map.items():
            check_member_name(name, str(index))
            self.files.setdefault(name, []).append(key)
        for name in self.files:
            if not (self.root / name).exists():
                raise FileNotFoundError(
                    f"{index} names {name}, which does not exist in {self.root}"
                )
        meta = data.get("metadata")
        recorded = meta.get(_CHECKSUMS_KEY) if isinstance(meta, dict) else None
        if recorded is not None:
            self.sums = _check_recorded(recorded, set(self.files), str(index))

    def header(self, name: str) -> tuple[list[str], dict[str, str]]:
        """The tensor names and header metadata of one file (confined, regular files only)."""
        fd = open_member(self.root, name, str(self.root))
        os.close(fd)
        try:
            with safe_open(str(self.root / name), framework="pt") as f:
                return list(f.keys()), dict(f.metadata() or {})
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise CheckpointCorruptionError(
                f"{self.root / name} is not a readable safetensors file: {exc!s:.160}"
            ) from exc

    def check_unverified(self) -> None:
        """With no recorded checksums: refuse hp-dcp's own files, warn once for foreign ones."""
        if self.sums is not None:
            return
        for name in self.files:
            if _CHECKSUMS_KEY in self.header(name)[1]:
                raise CheckpointCorruptionError(
                    f"{self.root / name} was written by hp-dcp with checksums in "
                    f"{HF_INDEX_FILE}, which is missing or lost them: it cannot be verified"
                )
        warnings.warn(
            f"{self.root} has no checksums (a HuggingFace checkpoint not written by hp-dcp): "
            "it is loaded unverified",
            UnverifiedCheckpointWarning,
            stacklevel=3,
        )

    def verify(self, name: str) -> None:
        """Check one file's size and CRC-32 against the index (no-op without checksums)."""
        if self.sums is None:
            return
        fd = open_member(self.root, name, str(self.root / HF_INDEX_FILE))
        try:
            expected = self.sums[name]
            size = os.fstat(fd).st_size
            if size != expected["size"]:
                raise CheckpointCorruptionError(
                    f"{self.root / name} has {size} bytes, the save wrote {expected['size']}"
                )
            got = crc32(b"")
            if size:
                with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
                    view = memoryview(mm)
                    try:
                        got = crc32(view)
                    finally:
                        view.release()
            if got != expected["crc32"]:
                raise CheckpointCorruptionError(
                    f"checksum mismatch in {self.root / name}: the file changed after it was "
                    "written (disk corruption or an edited copy)"
                )
        finally:
            os.close(fd)


def _check_recorded(recorded: Any, names: set[str], source: str) -> dict[str, dict[str, int]]:
    files = recorded.get("files") if isinstance(recorded, dict) else None
    if not isinstance(files, dict) or recorded.get("algorithm") != "crc32":
        raise CheckpointCorruptionError(f"{source} has a malformed {_CHECKSUMS_KEY} entry")
    for name in names:
        entry = files.get(name)
        if not (
            isinstance(entry, dict)
            and all(isinstance(entry.get(k), int) and entry[k] >= 0 for k in ("size", "crc32"))
        ):
            raise CheckpointCorruptionError(f"{source} records no valid checksum for {name}")
    return files


def hf_shard_files(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """List the safetensors files of a HuggingFace checkpoint and the tensors each holds.

    Uses ``model.safetensors.index.json`` when present, else every ``*.safetensors`` file.

    Args:
        path: the HuggingFace checkpoint directory.

    Returns:
        File name -> tensor names in that file, files in sorted order.

    Raises:
        FileNotFoundError: the directory holds no safetensors file, or the index names a
            missing file.
        CheckpointCorruptionError: the index or a file header is malformed.
        UnsafeCheckpointError: the index names a file outside the directory or one that is not
            a regular file.

    See Also:
        :pt:`torch.distributed.checkpoint.HuggingFaceStorageReader`: PyTorch's DCP-driven reader.
    """
    files = HFCheckpointFiles(Path(path)).files
    return {name: sorted(files[name]) for name in sorted(files)}


def iter_hf_tensors(
    path: str | os.PathLike[str], keys: Iterable[str] | None = None
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Read a HuggingFace safetensors checkpoint one file at a time.

    Args:
        path: the checkpoint directory.
        keys: read only these tensor names (default all).

    Returns:
        An iterator of ``(file name, {tensor name: tensor})``, one item per file holding any of
        the wanted tensors, so at most one file's tensors are in memory.

    Raises:
        FileNotFoundError: no safetensors files were found.
        CheckpointCorruptionError: a file fails its checksum, or the checksums of files written
            by hp-dcp are missing.
        UnsafeCheckpointError: the index names a file outside the directory.

    See Also:
        :pt:`torch.distributed.checkpoint.HuggingFaceStorageReader`: PyTorch's DCP-driven reader.
    """
    ckpt = HFCheckpointFiles(Path(path))
    ckpt.check_unverified()
    wanted = set(keys) if keys is not None else None
    for name in sorted(ckpt.files):
        selected = sorted(k for k in ckpt.files[name] if wanted is None or k in wanted)
        if not selected:
            continue
        ckpt.verify(name)
        with safe_open(str(ckpt.root / name), framework="pt") as f:
            yield name, {k: f.get_tensor(k) for k in selected}


def load_hf_safetensors(
    path: str | os.PathLike[str],
    *,
    keys: Iterable[str] | None = None,
    key_map: Callable[[str], str | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Read a (sharded) HuggingFace safetensors checkpoint into a state dict.

    Args:
        path: the checkpoint directory.
        keys: keyword-only; read only these tensor names (default all).
        key_map: keyword-only; renames each key, ``None`` drops it.

    Returns:
        Tensor name -> tensor (on CPU).

    Files written by :func:`save_hf_safetensors` are verified against the checksums in the
    index; other HuggingFace checkpoints load with one :class:`hp_dcp.UnverifiedCheckpointWarning`.

    Raises:
        FileNotFoundError: no safetensors files were found.
        ValueError: ``key_map`` sends two tensors to one name.
        CheckpointCorruptionError: a file fails its checksum or its checksums are missing.
        UnsafeCheckpointError: the index names a file outside the directory.

    See Also:
        :pt:`torch.distributed.checkpoint.HuggingFaceStorageReader`: PyTorch's DCP-driven reader.
    """
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for _, tensors in iter_hf_tensors(path, keys):
        for k, v in tensors.items():
            new = key_map(k) if key_map is not None else k
            if new is None:
                continue
            if new in origin:
                raise ValueError(
                    f"key_map sends both {origin[new]!r} and {k!r} to {new!r}; each kept tensor "
                    "needs its own name"
                )
            origin[new] = k
            out[new] = v
    return out
