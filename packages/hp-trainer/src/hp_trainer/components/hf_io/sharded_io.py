"""HuggingFace import/export where no rank holds the whole model.

Import: every rank reads, with safetensors' lazy slices, only the rows of each tensor its
DTensor shards hold (a range of whole heads where the adapter permutes rotary rows), after the
files' checksums were verified with the work split over the ranks. Export: every rank computes
the same plan from the tensors' global shapes (:class:`HFShardPlan`: HF's
``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_size`` bytes, in key order,
whatever the layout), each file is written by one rank from the full tensors it assembles one at
a time, and rank 0 writes the index (names -> files, with checksums).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hp_dcp.errors import CheckpointCorruptionError
from hp_dcp.huggingface import (
    HFCheckpointFiles,
    parse_size,
    save_hf_shard_file,
    write_hf_index,
)
from hp_dtensor._torch_compat import StridedShard, compute_local_shape_and_global_offset
from hp_dtensor.device import DEVICE_TYPE_CPU, DEVICE_TYPE_META
from hp_dtensor.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

__all__ = ["HFShardFile", "HFShardPlan", "HFShardedReader", "HFShardedWriter"]


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
    """Offset and size of this rank's shard in the global tensor (None: not a plain box).

    ``Shard``, ``Replicate`` and the ``_StridedShard`` of FSDP over TP (a box as well: the FSDP
    chunk of the TP chunk) are boxes; partial placements are not.
    """
    if not all(isinstance(p, Shard | StridedShard | Replicate) for p in value.placements):
        return None
    size, start = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    if tuple(value.to_local().shape) != tuple(size):
        return None
    return list(start), list(size)


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

    def _stacked(
        self,
        ckpt: HFCheckpointFiles,
        where: dict[str, str],
        key: str,
        value: torch.Tensor,
        names: Sequence[str],
    ) -> torch.Tensor:
        """A tensor stacked from HF tensors along dim 0 (MoE experts): only this rank's box."""
        for name in names:
            shape = self._read(ckpt, where, name, None)
            if (len(names), *shape) != tuple(value.shape):
                raise ValueError(
                    f"{ckpt.root}: {len(names)} x {name} of shape {list(shape)} do not stack "
                    f"into the model's {key} of shape {list(value.shape)}"
                )
        box = _local_box(value) if isinstance(value, DTensor) else None
        if box is None or not isinstance(value, DTensor):
            full = torch.stack([self._read(ckpt, where, name, ()) for name in names])
            if isinstance(value, DTensor):
                return distribute_tensor(
                    full, value.device_mesh, value.placements, src_data_rank=None
                )
            return full
        start, size = box
        inner = tuple(slice(s, s + n) for s, n in zip(start[1:], size[1:], strict=True))
        rows = [
            self._read(ckpt, where, names[j], inner) for j in range(start[0], start[0] + size[0])
        ]
        local = torch.stack(rows) if rows else torch.empty(size)
        return DTensor.from_local(
            local.to(dtype=value.dtype, device=value.to_local().device).contiguous(),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )

    def _shard(
        self, ckpt: HFCheckpointFiles, where: dict[str, str], key: str, value: torch.Tensor
    ) -> torch.Tensor:
        stacked = getattr(self.adapter, "hf_stacked_sources", None)
        names = stacked(key) if stacked is not None else None
        if names is not None:
            return self._stacked(ckpt, where, key, value, names)
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
        from hp_trainer.components.hf_io.adapters import half_to_interleaved_rotary

        return rows if heads is None else half_to_interleaved_rotary(rows, heads)

    def load(
        self,
        model_parts: Sequence[nn.Module],
        path: str | Path,
        *,
        skip: Callable[[str], bool] | None = None,
    ) -> None:
        """Load the parts' weights from the HF checkpoint at ``path`` (a collective).

        Args:
            model_parts: This rank's model parts.
            path: The HF checkpoint directory.
            skip: Keyword-only; keys of the model the checkpoint does not hold (LoRA adapters
                on an HF base model): left as they are.

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
        strict = len(model_parts) == 1 and skip is None
        for part in model_parts:
            own = get_model_state_dict(part)
            if skip is not None:
                own = {k: v for k, v in own.items() if not skip(k)}
            sd = {k: self._shard(ckpt, where, k, v) for k, v in sorted(own.items())}
            set_model_state_dict(part, sd, options=StateDictOptions(strict=strict))


_Described = tuple[
    "HFShardPlan", dict[str, list[int]], dict[str, tuple[tuple[int, ...], torch.dtype]]
]


@dataclass(frozen=True)
class HFShardFile:
    """One file of an export plan.

    Attributes:
        name: The file name (``model-00001-of-00003.safetensors``).
        keys: Our state-dict keys whose HF tensors the file holds, in order.
        writer: The rank (in the export group) that assembles and writes the file.
        nbytes: Bytes of the file's tensors.
    """

    name: str
    keys: tuple[str, ...]
    writer: int
    nbytes: int


@dataclass(frozen=True)
class HFShardPlan:
    """Which HF tensors go to which file, and which rank writes each file.

    The plan depends only on the tensors' global shapes and dtypes, so every layout (and one
    process) writes the same files. Tensors are packed in key order into files of at most
    ``max_shard_size`` bytes; a tensor larger than that gets a file of its own (HF's rule).
    A file is written by a rank holding all of its tensors when there is one (FSDP, TP, HSDP:
    every rank; files spread round-robin), else by a holder of its first tensor, which receives
    the others from their holders (pipeline stages).

    Attributes:
        files: The files, in order.
        weight_map: HF tensor name -> file name (the index's ``weight_map``).
        hf_names: Our key -> the HF tensors it becomes (none for a tied ``lm_head``).
        total_size: Bytes of all HF tensors (the index's ``metadata.total_size``).

    See Also:
        ``huggingface_hub.split_torch_state_dict_into_shards``: HF's planner.
    """

    files: tuple[HFShardFile, ...]
    weight_map: dict[str, str]
    hf_names: dict[str, tuple[str, ...]]
    total_size: int

    @classmethod
    def build(
        cls,
        adapter: Any,
        tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        holders: Mapping[str, Sequence[int]],
        max_shard_size: int,
    ) -> HFShardPlan:
        """Plan the files of an export.

        Args:
            adapter: The state-dict adapter (``to_hf`` is run on meta tensors for the sizes).
            tensors: Our key -> global shape and the dtype written.
            holders: Our key -> the ranks holding it.
            max_shard_size: The most bytes of one file (a larger tensor is alone in its file).

        Returns:
            The plan.
        """
        groups: list[list[str]] = [[]]
        hf_names: dict[str, tuple[str, ...]] = {}
        sizes: dict[str, int] = {}
        used = 0
        for key in sorted(tensors):
            shape, dtype = tensors[key]
            hf = adapter.to_hf({key: torch.empty(shape, dtype=dtype, device=DEVICE_TYPE_META)})
            hf_names[key] = tuple(hf)
            if not hf:  # e.g. a tied lm_head: HF stores the embedding once
                continue
            sizes[key] = sum(t.nbytes for t in hf.values())
            if groups[-1] and used + sizes[key] > max_shard_size:
                groups.append([])
                used = 0
            groups[-1].append(key)
            used += sizes[key]
        groups = [g for g in groups if g]
        files = []
        weight_map: dict[str, str] = {}
        for i, keys in enumerate(groups):
            name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            common = set(holders[keys[0]]).intersection(*(holders[k] for k in keys))
            candidates = sorted(common) or sorted(holders[keys[0]])
            files.append(
                HFShardFile(
                    name, tuple(keys), candidates[i % len(candidates)], sum(sizes[k] for k in keys)
                )
            )
            for key in keys:
                weight_map.update(dict.fromkeys(hf_names[key], name))
        return cls(tuple(files), weight_map, hf_names, sum(sizes.values()))


@dataclass
class HFShardedWriter:
    """Writes model parts as a HF checkpoint without gathering the model on one rank.

    Args:
        adapter: A state-dict adapter (``to_hf`` is applied one tensor at a time).
        process_group: The ranks that export together (default: the world).
        max_shard_size: Keyword-only; the most bytes of one safetensors file, as bytes or
            ``"5GB"``-style text (HF's ``max_shard_size``; a larger tensor gets its own file).

    Attributes:
        plan: The plan of the last :meth:`save`.
        written: HF names this rank wrote.
        files_written: File names this rank wrote.
        peak_held_bytes: The most bytes of full (gathered or converted) tensors this rank held
            at once during the last :meth:`save`: about one file plus one tensor.

    Raises:
        ValueError: ``max_shard_size`` is not a positive size.

    See Also:
        :pt:`torch.distributed.checkpoint.HuggingFaceStorageWriter`: PyTorch's DCP-driven writer;
        ``transformers.PreTrainedModel.save_pretrained``: HF's ``max_shard_size``.
    """

    adapter: Any
    process_group: dist.ProcessGroup | None = None
    _: KW_ONLY
    max_shard_size: int | str = "5GB"
    plan: HFShardPlan | None = None
    written: list[str] = field(default_factory=list)
    files_written: list[str] = field(default_factory=list)
    peak_held_bytes: int = 0

    def __post_init__(self) -> None:
        self._limit = parse_size(self.max_shard_size)

    def _global(self, rank: int) -> int:
        if self.process_group is None:
            return rank
        return dist.get_global_rank(self.process_group, rank)

    def _plan(self, states: dict[str, Any], dtype: torch.dtype | None) -> _Described:
        local = {}
        for key, value in states.items():
            out = value.dtype if dtype is None or not value.is_floating_point() else dtype
            local[key] = (tuple(value.shape), out)
        tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        holders: dict[str, list[int]] = {}
        for r, described in enumerate(_all_gather(local, self.process_group)):
            for key, spec in described.items():
                if tensors.setdefault(key, spec) != spec:
                    raise ValueError(
                        f"ranks disagree on {key}: {tensors[key]} and {spec} (rank {r})"
                    )
                holders.setdefault(key, []).append(r)
        return HFShardPlan.build(self.adapter, tensors, holders, self._limit), holders, tensors

    def _assemble(
        self,
        value: Any,
        spec: tuple[tuple[int, ...], torch.dtype],
        holders: Sequence[int],
        writer: int,
        turn: int,
        device: torch.device,
    ) -> torch.Tensor | None:
        """The full tensor (in the written dtype) on the file's writer, None elsewhere.

        Every holder joins the gather; a writer that does not hold the tensor (another
        pipeline stage) receives it from one holder, chosen by ``turn``, into a buffer on
        ``device`` (the device of its own shards, which the backend's point-to-point needs).
        """
        rank, _ = _world(self.process_group)
        if value is not None:
            if isinstance(value, DTensor):
                value = value.full_tensor()
            value = value.to(spec[1])
        if writer in holders:
            return value if rank == writer else None
        sender = holders[turn % len(holders)]
        if rank == sender:
            dist.send(value.contiguous(), self._global(writer), group=self.process_group)
        elif rank == writer:
            received = torch.empty(spec[0], dtype=spec[1], device=device)
            dist.recv(received, self._global(sender), group=self.process_group)
            return received
        return None

    def save(
        self,
        model_parts: Sequence[nn.Module],
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Write the files of :class:`HFShardPlan`, each by its writer, then the index.

        A collective every rank of the group joins. Each tensor is gathered by the ranks holding
        it; the file's writer keeps it (converted to HF's layout, in host memory) until the file
        is written, the others drop it at once, so a rank holds at most one file's tensors plus
        one tensor.

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
        plan, holders, specs = self._plan(states, dtype)
        local = [v.to_local() if isinstance(v, DTensor) else v for v in states.values()]
        device = local[0].device if local else torch.device(DEVICE_TYPE_CPU)
        del local
        self.plan = plan
        self.peak_held_bytes = 0
        out = Path(path)
        sums: dict[str, dict[str, int]] = {}
        for j, file in enumerate(plan.files):
            pending: dict[str, torch.Tensor] = {}
            held = 0
            for key in file.keys:
                full = self._assemble(
                    states.get(key), specs[key], holders[key], file.writer, j, device
                )
                if full is None:
                    continue
                hf = self.adapter.to_hf({key: full})
                fresh = sum(t.nbytes for t in hf.values() if t.data_ptr() != full.data_ptr())
                self.peak_held_bytes = max(self.peak_held_bytes, held + full.nbytes + fresh)
                held += sum(t.nbytes for t in hf.values())
                pending.update({k: t.cpu() for k, t in hf.items()})  # accelerator memory: 1 tensor
                del full, hf
            if rank == file.writer:
                sums[file.name] = save_hf_shard_file(pending, out, file.name)
                self.written.extend(pending)
                self.files_written.append(file.name)
            del pending
        gathered = _all_gather(sums, self.process_group)
        if rank == 0:
            all_sums: dict[str, dict[str, int]] = {}
            for s in gathered:
                all_sums.update(s)
            write_hf_index(out, plan.weight_map, all_sums, plan.total_size)
