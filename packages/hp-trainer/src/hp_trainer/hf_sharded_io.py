"""HuggingFace import/export where no rank holds the whole model.

Import: every rank reads, with safetensors' lazy slices, only the rows of each tensor its
DTensor shards hold (a range of whole heads where the adapter permutes rotary rows), after the
files' checksums were verified with the work split over the ranks. Export: tensors are assigned
round-robin to the ranks that hold them; a tensor is gathered, its owner writes it into a file
of its own and drops it, so no rank holds more than one full tensor beyond its shards; rank 0
writes the index (names -> files, with checksums) from what every rank wrote.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hp_dcp.errors import CheckpointCorruptionError
from hp_dcp.huggingface import HFCheckpointFiles, save_hf_shard_file, write_hf_index
from hp_dtensor.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

__all__ = ["HFShardedReader", "HFShardedWriter"]


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if _world(group)[1] == 1:
        return [obj]
    out: list[Any] = [None] * _world(group)[1]
    dist.all_gather_object(out, obj, group=group)
    return out


def _local_box(value: DTensor) -> tuple[list[int], list[int]] | None:
    """Offset and size of this rank's shard in the global tensor (None: not a plain box)."""
    start = [0] * value.dim()
    size = list(value.shape)
    mesh = value.device_mesh
    for mesh_dim, placement in enumerate(value.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:  # strided/partial layouts: read the whole tensor
            return None
        d = placement.dim
        n, c = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        chunk = math.ceil(size[d] / n) if size[d] else 0
        begin = min(c * chunk, size[d])
        start[d] += begin
        size[d] = max(0, min(chunk, size[d] - begin))
    if list(value.to_local().shape) != size:
        return None
    return start, size


@dataclass
class HFShardedReader:
    """Reads a HF checkpoint into model parts, each rank only the byte ranges it owns.

    Args:
        adapter: A state-dict adapter with ``hf_source`` (e.g. ``Llama3StateDictAdapter``).
        process_group: The ranks that load together (default: the world).

    Attributes:
        reads: ``(hf name, shape read)`` per slice read on this rank, in order.
        bytes_read: Tensor bytes read from the files on this rank.

    See Also:
        :pt:`torch.distributed.checkpoint.HuggingFaceStorageReader`: PyTorch's DCP-driven reader.
    """

    adapter: Any
    process_group: dist.ProcessGroup | None = None
    reads: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    bytes_read: int = 0

    def _verify(self, ckpt: HFCheckpointFiles) -> None:
        """Checksum every file once, the files split round-robin over the ranks."""
        rank, world = _world(self.process_group)
        error = ""
        for i, name in enumerate(sorted(ckpt.files)):
            if i % world == rank:
                try:
                    ckpt.verify(name)
                except CheckpointCorruptionError as exc:
                    error = error or str(exc)
        errors = [e for e in _all_gather(error, self.process_group) if e]
        if errors:
            raise CheckpointCorruptionError(errors[0])

    def _read(self, ckpt: HFCheckpointFiles, where: dict[str, str], name: str, index: Any) -> Any:
        if name not in where:
            raise KeyError(f"{ckpt.root} holds no tensor {name!r}")
        with safe_open(str(ckpt.root / where[name]), framework="pt") as f:
            part = f.get_slice(name)
            shape = tuple(part.get_shape())
            if index is None:
                return shape
            out: torch.Tensor = part[index]
        self.reads.append((name, tuple(out.shape)))
        self.bytes_read += out.nbytes
        return out

    def _shard(
        self, ckpt: HFCheckpointFiles, where: dict[str, str], key: str, value: torch.Tensor
    ) -> torch.Tensor:
        name, heads = self.adapter.hf_source(key)
        shape = self._read(ckpt, where, name, None)
        if shape != tuple(value.shape):
            raise ValueError(
                f"{ckpt.root}: {name} has shape {list(shape)}, the model's {key} has "
                f"{list(value.shape)}"
            )
        box = _local_box(value) if isinstance(value, DTensor) else None
        if box is None or not isinstance(value, DTensor):
            full = self._convert(self._read(ckpt, where, name, ()), heads)
            if isinstance(value, DTensor):
                return distribute_tensor(
                    full, value.device_mesh, value.placements, src_data_rank=None
                )
            return full
        start, size = box
        index = [slice(s, s + n) for s, n in zip(start, size, strict=True)]
        lo = 0
        if heads is not None and size[0]:
            head_dim = shape[0] // heads
            first, last = start[0] // head_dim, -(-(start[0] + size[0]) // head_dim)
            lo = start[0] - first * head_dim
            index[0] = slice(first * head_dim, last * head_dim)
            heads = last - first
        rows = self._read(ckpt, where, name, tuple(index))
        if heads is not None and size[0]:
            rows = self._convert(rows, heads)[lo : lo + size[0]]
        local = rows.to(dtype=value.dtype, device=value.to_local().device).contiguous()
        return DTensor.from_local(
            local,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )

    @staticmethod
    def _convert(rows: torch.Tensor, heads: int | None) -> torch.Tensor:
        from hp_trainer.hf_adapters import half_to_interleaved_rotary

        return rows if heads is None else half_to_interleaved_rotary(rows, heads)

    def load(self, model_parts: Sequence[nn.Module], path: str | Path) -> None:
        """Load the parts' weights from the HF checkpoint at ``path`` (a collective).

        Args:
            model_parts: This rank's model parts.
            path: The HF checkpoint directory.

        Raises:
            KeyError: The checkpoint lacks a tensor of the model.
            ValueError: A tensor's shape differs from the model's.
            CheckpointCorruptionError: A file fails its checksum.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager` with ``initial_load_in_hf``.
        """
        ckpt = HFCheckpointFiles(Path(path))
        ckpt.check_unverified()
        self._verify(ckpt)
        where = {key: name for name, keys in ckpt.files.items() for key in keys}
        strict = len(model_parts) == 1
        for part in model_parts:
            own = get_model_state_dict(part)
            sd = {k: self._shard(ckpt, where, k, v) for k, v in sorted(own.items())}
            set_model_state_dict(part, sd, options=StateDictOptions(strict=strict))


@dataclass
class HFShardedWriter:
    """Writes model parts as a HF checkpoint without gathering the model on one rank.

    Args:
        adapter: A state-dict adapter (``to_hf`` is applied one tensor at a time).
        process_group: The ranks that export together (default: the world).

    Attributes:
        peak_full_tensors: The most gathered full tensors this rank held at once.
        written: HF names this rank wrote.

    See Also:
        :pt:`torch.distributed.checkpoint.HuggingFaceStorageWriter`: PyTorch's DCP-driven writer.
    """

    adapter: Any
    process_group: dist.ProcessGroup | None = None
    peak_full_tensors: int = 0
    written: list[str] = field(default_factory=list)

    def save(
        self,
        model_parts: Sequence[nn.Module],
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Write one safetensors file per tensor, by its owner, then the index (a collective).

        Args:
            model_parts: This rank's model parts.
            path: The output directory.
            dtype: Cast floating-point tensors to this dtype.

        See Also:
            :titan:`torchtitan.components.checkpoint.CheckpointManager` with ``last_save_in_hf``.
        """
        rank, _ = _world(self.process_group)
        states: dict[str, Any] = {}
        for part in model_parts:
            states.update(get_model_state_dict(part))
        holders: dict[str, list[int]] = {}
        for r, keys in enumerate(_all_gather(sorted(states), self.process_group)):
            for key in keys:
                holders.setdefault(key, []).append(r)
        order = sorted(holders)
        out = Path(path)
        entries: dict[str, str] = {}
        sums: dict[str, dict[str, int]] = {}
        total = 0
        held = 0
        for i, key in enumerate(order):
            if key not in states:
                continue
            owner = holders[key][i % len(holders[key])]
            value = states[key]
            if isinstance(value, DTensor):
                value = value.full_tensor()  # every holder joins; non-owners drop it at once
                held += 1
                self.peak_full_tensors = max(self.peak_full_tensors, held)
            if rank == owner:
                if dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
                hf = self.adapter.to_hf({key: value})
                if hf:
                    name = f"model-{i + 1:05d}-of-{len(order):05d}.safetensors"
                    sums[name] = save_hf_shard_file(hf, out, name)
                    entries.update(dict.fromkeys(hf, name))
                    total += sum(t.nbytes for t in hf.values())
                    self.written.extend(hf)
                del hf
            if isinstance(states[key], DTensor):
                held -= 1
            del value
        gathered = _all_gather((entries, sums, total), self.process_group)
        if rank == 0:
            weight_map: dict[str, str] = {}
            all_sums: dict[str, dict[str, int]] = {}
            for e, s, _ in gathered:
                weight_map.update(e)
                all_sums.update(s)
            write_hf_index(out, weight_map, all_sums, sum(t for _, _, t in gathered))
