"""HuggingFace safetensors checkpoints: sharded ``model-0000x-of-0000y.safetensors`` + index."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "HF_INDEX_FILE",
    "hf_shard_files",
    "iter_hf_tensors",
    "load_hf_safetensors",
    "parse_size",
    "save_hf_safetensors",
]

HF_INDEX_FILE = "model.safetensors.index.json"
"""Name of the index json mapping each tensor to its shard file."""

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
    tensor gets a shard of its own). Each file is written under a temporary name and renamed, the
    index last, so readers never see a half-written file. Other files in ``path`` (``config.json``
    and the like) are left alone.

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
        ``torch.distributed.checkpoint.HuggingFaceStorageWriter``: PyTorch's DCP-driven writer.
    """
    limit = parse_size(max_shard_size)
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"safetensors holds tensors only; {key!r} is a {type(value).__name__}")
    keys = sorted(state_dict)
    shards = _plan_shards(((k, state_dict[k].nbytes) for k in keys), limit)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    names: list[str] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = _shard_name(i, len(shards))
        tensors = {k: state_dict[k].detach().cpu().contiguous() for k in shard}
        tmp = out / f".{name}.tmp"
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, out / name)
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    index = {
        "metadata": {"total_size": sum(state_dict[k].nbytes for k in keys)},
        "weight_map": weight_map,
    }
    tmp_index = out / f".{HF_INDEX_FILE}.tmp"
    tmp_index.write_text(json.dumps(index, indent=2, sort_keys=True))
    os.replace(tmp_index, out / HF_INDEX_FILE)
    return names


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

    See Also:
        ``torch.distributed.checkpoint.HuggingFaceStorageReader``: PyTorch's DCP-driven reader.
    """
    root = Path(path)
    index = root / HF_INDEX_FILE
    files: dict[str, list[str]] = {}
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for key, name in weight_map.items():
            files.setdefault(name, []).append(key)
        for name in files:
            if not (root / name).is_file():
                raise FileNotFoundError(f"{index} names {name}, which does not exist in {root}")
    else:
        for file in sorted(root.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                files[file.name] = list(f.keys())
    if not files:
        raise FileNotFoundError(f"no safetensors files in {root}")
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

    See Also:
        ``torch.distributed.checkpoint.HuggingFaceStorageReader``: PyTorch's DCP-driven reader.
    """
    root = Path(path)
    wanted = set(keys) if keys is not None else None
    for name, names in hf_shard_files(root).items():
        selected = [k for k in names if wanted is None or k in wanted]
        if not selected:
            continue
        with safe_open(str(root / name), framework="pt") as f:
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

    Raises:
        FileNotFoundError: no safetensors files were found.
        ValueError: ``key_map`` sends two tensors to one name.

    See Also:
        ``torch.distributed.checkpoint.HuggingFaceStorageReader``: PyTorch's DCP-driven reader.
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
