"""One pipeline stage: a submodule, its per-micro-batch state, and what it sends and receives.

A stage runs its submodule on one micro-batch at a time and keeps what backward needs (inputs
and outputs per micro-batch). Between stages on different ranks, activations and gradients move
as point-to-point messages that the executor posts in batches (``dist.batch_isend_irecv``, one
batch per step of the transport plan, see :mod:`hp_pp.transport`). The stage says what a message
is made of (:class:`_Part`: the tensor, the peer and the message's identity); it never posts on
its own. No tags are used: messages between two ranks match in posting order, as on NCCL.

What moves between two stages is described once, on the first step: the sending stage's first
message carries a description of its outputs (shape, dtype, ``requires_grad``, DTensor
placements, which outputs are not tensors) as a fixed-size byte tensor *on the stage's device*
(JSON, never pickled); the receiving stage allocates its buffers from it and checks it against
``input_args`` when those were declared. Later steps reuse it as the size of the buffers. Each
message also carries its tensors' shapes (a few ``int64`` values, posted in the same batch), so
a micro-batch smaller than the first one (an uneven split, a short last batch) travels padded
in those buffers and arrives with its own shape: one host read of those values per received
message. A stage whose outputs grow beyond the description, or change kind, dtype or rank,
raises :class:`PipeliningMetadataError` (PyTorch's type, and a ``ValueError``) before sending.
Non-tensor outputs (Python values) travel per micro-batch as a length and a byte tensor on the
device, read back with ``weights_only=True`` (plain Python values only). Nothing the stage hands
to a collective or point-to-point call lives on the CPU unless the stage's device is the CPU.

The last stage keeps each micro-batch's output only when the step was asked to return it
(``return_outputs=True``, torch's rule): otherwise it keeps nothing beyond the loss.

Tied parameters (an embedding on the first stage and the output head on the last sharing one
weight): give each stage ``tied_parameters={"<fqn in this submodule>": "<tie name>"}``; the
schedule finds the ranks holding each tie once, at set-up, and after the backward of a step sums
the gradients of a tie over a group of just those ranks (nothing when they are all on one rank).

See Also:
    :pt:`torch.distributed.pipelining.PipelineStage`
"""

from __future__ import annotations

import datetime
import io
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from hp_pp._backward import WeightPass, backward_input, cut_from_graph
from hp_pp._fsdp_protocol import FSDPControl
from hp_pp._torch_compat import TorchPipeliningMetadataError

__all__ = ["PipelineStage", "PipeliningMetadataError"]


class PipeliningMetadataError(TorchPipeliningMetadataError, ValueError):
    """A stage's outputs do not match what the next stage expects (shape, dtype, kind).

    Raised by the sending stage before it sends (its outputs changed since the description it
    sent on the first step) and by a stage whose declared ``input_args``/``output_args`` do not
    match what the pipeline carries. It is PyTorch's exception type (``except`` clauses written
    for torch's pipelining catch it) and a :class:`ValueError` (hp-pp raised that before).

    See Also:
        :pt:`torch.distributed.pipelining.stage.PipelineStage`: raises
        :pt:`torch.distributed.pipelining._utils.PipeliningMetadataError` for the same
        mismatches.
    """


#: Bytes of the description message (JSON, space-padded): enough for dozens of outputs.
_META_BYTES = 8192


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)


def _from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)


def _meta_to_tensor(plain: Any, device: torch.device, what: str) -> torch.Tensor:
    raw = json.dumps(plain).encode()
    if len(raw) > _META_BYTES:
        raise ValueError(
            f"{what}: the description of the outputs takes {len(raw)} bytes, more than the "
            f"{_META_BYTES} a stage description may hold (too many outputs for one stage)"
        )
    padded = raw + b" " * (_META_BYTES - len(raw))
    return torch.frombuffer(bytearray(padded), dtype=torch.uint8).to(device)


def _meta_from_tensor(data: torch.Tensor) -> Any:
    return json.loads(bytes(data.cpu().numpy().tobytes()).decode())


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a stage description")
    return dtype


def _placement_to_spec(p: Placement) -> tuple[Any, ...]:
    if isinstance(p, Shard):
        return ("S", p.dim)
    if isinstance(p, Replicate):
        return ("R",)
    if isinstance(p, Partial):
        return ("P", str(p.reduce_op))
    raise ValueError(f"placement {p!r} cannot cross a pipeline stage boundary")


def _placement_from_spec(spec: tuple[Any, ...]) -> Placement:
    if spec[0] == "S":
        return Shard(int(spec[1]))
    if spec[0] == "R":
        return Replicate()
    return Partial(str(spec[1]))


@dataclass(frozen=True)
class _ValueMeta:
    """What one stage output is, as the next stage needs to know it."""

    kind: str  # "tensor", "dtensor" or "object"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    requires_grad: bool = False
    global_shape: tuple[int, ...] = ()
    global_stride: tuple[int, ...] = ()
    placements: tuple[tuple[Any, ...], ...] = ()
    mesh_dim_names: tuple[str, ...] = ()

    @classmethod
    def of(cls, value: Any) -> _ValueMeta:
        if isinstance(value, DTensor):
            local = value.to_local()
            return cls(
                "dtensor",
                tuple(local.shape),
                str(value.dtype),
                value.requires_grad,
                tuple(value.shape),
                tuple(value.stride()),
                tuple(_placement_to_spec(p) for p in value.placements),
                tuple(value.device_mesh.mesh_dim_names or ()),
            )
        if isinstance(value, torch.Tensor):
            return cls("tensor", tuple(value.shape), str(value.dtype), value.requires_grad)
        return cls("object")

    def to_plain(self) -> tuple[Any, ...]:
        return (
            self.kind,
            self.shape,
            self.dtype,
            self.requires_grad,
            self.global_shape,
            self.global_stride,
            self.placements,
            self.mesh_dim_names,
        )

    @classmethod
    def from_plain(cls, plain: Any) -> _ValueMeta:
        kind, shape, dtype, rg, gshape, gstride, placements, names = plain
        return cls(
            str(kind),
            tuple(shape),
            str(dtype),
            bool(rg),
            tuple(gshape),
            tuple(gstride),
            tuple(tuple(p) for p in placements),
            tuple(names),
        )

    @property
    def carries_grad(self) -> bool:
        return self.kind != "object" and self.requires_grad

    def describe(self) -> str:
        if self.kind == "object":
            return "a non-tensor value"
        return f"{self.kind} of shape {self.shape} and dtype {self.dtype}"


def _normalize_output(output: Any) -> tuple[Any, ...]:
    return tuple(output) if isinstance(output, tuple | list) else (output,)


def _detach_output(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, tuple | list):
        return type(output)(_detach_output(o) for o in output)
    return output


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).contiguous()


def _padded(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` in a zero buffer of ``shape`` (no copy when it already has that shape)."""
    if tuple(t.shape) == tuple(shape):
        return t
    buf = t.new_zeros(shape)
    buf[tuple(slice(0, d) for d in t.shape)] = t
    return buf


@dataclass
class _Part:
    """One tensor of one message: posted by the executor in a batch.

    ``ident`` is ``(sending stage, micro-batch, "F" | "B" | "PRE", part)``, the part being
    ``"meta"``, ``"data<i>"``, ``"obj_len"`` or ``"obj"``; ``peer`` is a global rank. The
    executor sets ``batch`` when it posts the part.
    """

    kind: str
    tensor: torch.Tensor
    peer: int
    ident: tuple[int, int, str, str]
    batch: Any = None


@dataclass
class _PendingRecv:
    """Receives of one message: the parts posted so far and the buffers to read."""

    parts: list[_Part] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    object_len: torch.Tensor | None = None
    object_payload: torch.Tensor | None = None
    header: torch.Tensor | None = None


@dataclass
class _MicrobatchState:
    inputs: tuple[Any, ...] | None = None
    input_leaves: list[torch.Tensor] = field(default_factory=list)
    outputs: tuple[Any, ...] | None = None
    loss: torch.Tensor | None = None
    output_grads: list[torch.Tensor | None] | None = None
    input_grads: list[torch.Tensor | None] | None = None
    weight_pending: bool = False
    dw_runner: Callable[..., None] | None = None
    weight_pass: WeightPass | None = None
    input_shapes: list[tuple[int, ...]] | None = None


class PipelineStage:
    """One stage of a pipeline: a submodule and the transfers to its neighbours.

    Args:
        submodule: The part of the model this stage runs.
        stage_index: Index of this stage (0-based).
        num_stages: Number of stages of the whole pipeline.
        device: Device of the stage's activations.
        input_args: Example inputs (a tensor or tuple of tensors). Optional: when given, the
            shapes and dtypes the previous stage announces on the first step must match them.
        output_args: Example outputs, checked the same way against what the stage produces.
        output_grads: Accepted for PyTorch compatibility; gradients always take the shape of
            the outputs they belong to.
        input_grads: Accepted for PyTorch compatibility (see ``output_grads``).
        group: The pipeline process group (default: the world group).
        dw_builder: Returns a callable that computes the weight gradients of one micro-batch;
            when given, backward-input runs the full backward and backward-weight calls it.
        get_mesh: ``get_mesh(mesh_dim_names, layout)`` returns the device mesh on which to
            rebuild a received DTensor activation (default: the mesh of a declared DTensor
            input, else of a DTensor parameter of ``submodule`` with the same dim names).
        tied_parameters: Keyword-only. ``{fqn in submodule: tie name}``: parameters shared with
            other stages; their gradients are summed across the pipeline group after backward.
        timeout: Keyword-only. How long a wait for a send or receive may take before it raises
            ``RuntimeError`` naming this rank, the peer rank and the transfer (default: the
            process group's timeout). A peer that died or raised makes this rank fail, not hang.
        shape_headers: Keyword-only. Send each activation message's shapes with it, so later
            micro-batches may be smaller than the first (uneven micro-batches, ``tensor_split``
            semantics): the receiver reads a few integers per message, a host sync per message
            on an accelerator. ``False``: every micro-batch must have the first one's shapes
            (a differing one raises :class:`PipeliningMetadataError` on the sender) and no
            message costs a host read; for jobs whose batches always divide evenly (hp-trainer
            passes it). Must be the same on every stage.

    Raises:
        ValueError: ``stage_index`` outside ``[0, num_stages)``, or an unknown tied parameter.
        RuntimeError: the default process group is not initialized.

    See Also:
        :pt:`torch.distributed.pipelining.PipelineStage`
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_grads: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None,
        input_grads: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None,
        group: dist.ProcessGroup | None = None,
        dw_builder: Callable[[], Callable[..., None]] | None = None,
        get_mesh: Callable[..., DeviceMesh] | None = None,
        *,
        tied_parameters: Mapping[str, str] | None = None,
        timeout: datetime.timedelta | None = None,
        shape_headers: bool = True,
    ) -> None:
        if not isinstance(shape_headers, bool):
            raise TypeError(f"shape_headers must be a bool, got {shape_headers!r}")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(
                f"stage_index must be in [0, {num_stages}) for num_stages={num_stages}, "
                f"got {stage_index!r}"
            )
        if not dist.is_initialized():
            raise RuntimeError("PipelineStage needs an initialized default process group")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group
        self.group_rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.dw_builder = dw_builder
        self.timeout = timeout
        self._get_mesh = get_mesh
        del output_grads, input_grads  # gradients take the shape of their tensors
        self._declared_inputs = self._declared_metas(input_args)
        self._declared_outputs = self._declared_metas(output_args)
        self._declared_meshes = [
            t.device_mesh
            for t in _normalize_output(input_args) + _normalize_output(output_args)
            if isinstance(t, DTensor)
        ]
        params = dict(submodule.named_parameters())
        self.tied_parameters = dict(tied_parameters or {})
        for fqn in self.tied_parameters:
            if fqn not in params:
                raise ValueError(
                    f"tied_parameters names {fqn!r}, which is not a parameter of stage "
                    f"{stage_index}'s submodule"
                )
        self.fsdp = FSDPControl.of(submodule)
        # Set by the schedule: which group rank holds each stage.
        self.stage_to_group_rank: dict[int, int] = {
            s: s % self.group_size for s in range(num_stages)
        }
        self._input_meta: list[_ValueMeta] | None = None
        self._output_meta: list[_ValueMeta] | None = None
        self._mb: dict[int, _MicrobatchState] = {}
        self._recv_fwd: dict[int, _PendingRecv] = {}
        self._recv_bwd: dict[int, _PendingRecv] = {}
        self._recv_pre: dict[int, _PendingRecv] = {}
        # MPipe: the description of the preprocess output, per sending group rank.
        self._pre_meta: dict[int, tuple[tuple[int, ...], str]] = {}
        self._pre_meta_sent = False
        # Per-message shape headers already on the device, by shapes.
        self._headers: dict[tuple[tuple[int, ...], ...], torch.Tensor] = {}
        self.shape_headers = shape_headers
        self.output_chunks: dict[int, Any] = {}
        #: Whether the last stage keeps each micro-batch's output for the step to return
        #: (set by the schedule from ``return_outputs``).
        self.save_forward_output = True

    # -- identity ---------------------------------------------------------------------------

    @property
    def is_first(self) -> bool:
        """Whether this is stage 0 (it receives the step's arguments)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this is the last stage (it computes the loss)."""
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return (
            f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, "
            f"group_rank={self.group_rank})"
        )

    @staticmethod
    def _declared_metas(args: Any) -> list[_ValueMeta] | None:
        if args is None:
            return None
        return [_ValueMeta.of(a) for a in _normalize_output(args)]

    def _peer(self, stage_index: int) -> int:
        group_rank = self.stage_to_group_rank[stage_index]
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def is_local(self, stage_index: int) -> bool:
        """Whether ``stage_index`` runs on this rank."""
        return self.stage_to_group_rank[stage_index] == self.group_rank

    # -- step bookkeeping -------------------------------------------------------------------

    def clear_runtime_states(self) -> None:
        """Drop the per-micro-batch state of the last step (its transfers must have completed)."""
        self._mb.clear()
        self._recv_fwd.clear()
        self._recv_bwd.clear()
        self._recv_pre.clear()
        self.output_chunks.clear()

    def _state(self, mb: int) -> _MicrobatchState:
        return self._mb.setdefault(mb, _MicrobatchState())

    def has_forward(self, mb: int) -> bool:
        """Whether micro-batch ``mb``'s forward ran this step and its outputs are kept."""
        state = self._mb.get(mb)
        return state is not None and state.outputs is not None

    def has_output_grads(self, mb: int) -> bool:
        """Whether micro-batch ``mb``'s output gradients are here (received or handed over)."""
        state = self._mb.get(mb)
        return state is not None and state.output_grads is not None

    def group_peer(self, group_rank: int) -> int:
        """The global rank of pipeline-group rank ``group_rank``."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- MPipe's transposed preprocess -------------------------------------------------------

    def preprocess_send_parts(self, mb: int, output: torch.Tensor) -> list[_Part]:
        """The parts that ship micro-batch ``mb``'s preprocess output to stage 0's rank (the
        first one also carries its shape and dtype)."""
        peer = self._peer(0)
        tensor = output.detach().contiguous()
        parts: list[_Part] = []
        if not self._pre_meta_sent:
            self._pre_meta_sent = True
            plain = [list(tensor.shape), str(tensor.dtype)]
            meta = _meta_to_tensor(plain, self.device, "MPipe's preprocess output")
            parts.append(_Part("send", meta, peer, (0, mb, "PRE", "meta")))
        parts.append(_Part("send", tensor, peer, (0, mb, "PRE", "data0")))
        return parts

    def preprocess_recv_parts(
        self, mb: int, from_group_rank: int
    ) -> Iterator[tuple[list[_Part], bool]]:
        """The receives of micro-batch ``mb``'s preprocess output (stage 0), in rounds: the
        executor posts each round's parts and waits for them before the next when asked."""
        peer = self.group_peer(from_group_rank)
        pending = self._recv_pre.setdefault(mb, _PendingRecv())
        if from_group_rank not in self._pre_meta:
            meta = torch.empty(_META_BYTES, dtype=torch.uint8, device=self.device)
            part = _Part("recv", meta, peer, (0, mb, "PRE", "meta"))
            pending.parts.append(part)
            yield [part], True
            shape, dtype = _meta_from_tensor(meta)
            self._pre_meta[from_group_rank] = (tuple(shape), str(dtype))
        shape, dtype = self._pre_meta[from_group_rank]
        buf = torch.empty(shape, dtype=_dtype_from_name(dtype), device=self.device)
        part = _Part("recv", buf, peer, (0, mb, "PRE", "data0"))
        pending.parts.append(part)
        pending.buffers.append(buf)
        yield [part], False

    def take_received_preprocess(self, mb: int) -> torch.Tensor:
        """Micro-batch ``mb``'s preprocess output, once its receives completed."""
        return self._recv_pre.pop(mb).buffers[0]

    # -- forward ----------------------------------------------------------------------------

    @property
    def knows_input_meta(self) -> bool:
        """Whether this stage's input description has arrived."""
        return self._input_meta is not None

    def activation_recv_parts(self, mb: int) -> Iterator[tuple[list[_Part], bool]]:
        """The receives of micro-batch ``mb``'s inputs from the previous stage, in rounds.

        Each round is ``(parts, wait)``: the executor posts ``parts`` (with the rest of its
        batch) and, when ``wait``, waits for that batch before asking for the next round (the
        buffers of what follows depend on what arrived: the description on the first step,
        the size of non-tensor values).
        """
        src_stage = self.stage_index - 1
        peer = self._peer(src_stage)
        pending = self._recv_fwd.setdefault(mb, _PendingRecv())
        if self._input_meta is None:
            meta = torch.empty(_META_BYTES, dtype=torch.uint8, device=self.device)
            part = _Part("recv", meta, peer, (src_stage, mb, "F", "meta"))
            pending.parts.append(part)
            yield [part], True
            metas = [_ValueMeta.from_plain(p) for p in _meta_from_tensor(meta)]
            self._check_declared(metas, self._declared_inputs, "inputs")
            self._input_meta = metas
        parts: list[_Part] = []
        ndim = sum(len(m.shape) for m in self._input_meta if m.kind != "object")
        if ndim and self.shape_headers:
            pending.header = torch.empty(ndim, dtype=torch.int64, device=self.device)
            parts.append(_Part("recv", pending.header, peer, (src_stage, mb, "F", "shape")))
        for i, m in enumerate(m for m in self._input_meta if m.kind != "object"):
            buf = torch.empty(m.shape, dtype=_dtype_from_name(m.dtype), device=self.device)
            pending.buffers.append(buf)
            parts.append(_Part("recv", buf, peer, (src_stage, mb, "F", f"data{i}")))
        has_objects = any(m.kind == "object" for m in self._input_meta)
        if has_objects:
            pending.object_len = torch.zeros(1, dtype=torch.int64, device=self.device)
            parts.append(_Part("recv", pending.object_len, peer, (src_stage, mb, "F", "obj_len")))
        pending.parts += parts
        yield parts, has_objects
        if has_objects:
            assert pending.object_len is not None
            payload = torch.empty(
                int(pending.object_len.item()), dtype=torch.uint8, device=self.device
            )
            pending.object_payload = payload
            part = _Part("recv", payload, peer, (src_stage, mb, "F", "obj"))
            pending.parts.append(part)
            yield [part], False

    def received_parts(self, what: str, mb: int) -> list[_Part]:
        """The posted receives of message ``what`` (``"F"``, ``"B"``, ``"PRE"``) of ``mb``."""
        table = {"F": self._recv_fwd, "B": self._recv_bwd, "PRE": self._recv_pre}[what]
        pending = table.get(mb)
        return [] if pending is None else list(pending.parts)

    def has_posted_recv_activations(self, mb: int) -> bool:
        """Whether the receives of micro-batch ``mb``'s inputs are posted."""
        return mb in self._recv_fwd

    def take_received_activations(self, mb: int) -> None:
        """Make micro-batch ``mb``'s received inputs this stage's inputs (after the wait)."""
        pending = self._recv_fwd.pop(mb)
        assert self._input_meta is not None
        objects: list[Any] = []
        if pending.object_payload is not None:
            objects = list(_from_bytes(pending.object_payload))
        shapes = self._received_shapes(pending)
        tensors = iter(pending.buffers)
        objs = iter(objects)
        values: list[Any] = []
        for meta in self._input_meta:
            if meta.kind == "object":
                values.append(next(objs))
                continue
            buf = next(tensors)
            shape = next(shapes)
            if shape != meta.shape:
                # A smaller micro-batch (uneven split): the sender padded it to the buffer.
                buf = buf[tuple(slice(0, d) for d in shape)].contiguous()
            if meta.kind == "dtensor":
                mesh = self._mesh_for(meta)
                value: torch.Tensor = DTensor.from_local(
                    buf,
                    mesh,
                    [_placement_from_spec(p) for p in meta.placements],
                    run_check=False,
                    shape=torch.Size(meta.global_shape),
                    stride=meta.global_stride,
                )
                value = value.detach()
            else:
                value = buf
            values.append(value.requires_grad_(meta.requires_grad))
        state = self._state(mb)
        state.inputs = tuple(values)
        state.input_shapes = [
            tuple(v.shape) for v in values if isinstance(v, torch.Tensor) and v.requires_grad
        ]

    def _received_shapes(self, pending: _PendingRecv) -> Iterator[tuple[int, ...]]:
        """The shapes of a received message's tensors, from its shape header (one host read
        of a few integers per message), or the announced ones without headers."""
        assert self._input_meta is not None
        metas = [m for m in self._input_meta if m.kind != "object"]
        if pending.header is None:  # without headers every message has the announced shapes
            yield from (tuple(m.shape) for m in metas)
            return
        flat = pending.header.tolist()
        pos = 0
        for m in metas:
            n = len(m.shape)
            yield tuple(int(d) for d in flat[pos : pos + n])
            pos += n

    def _mesh_for(self, meta: _ValueMeta) -> DeviceMesh:
        for mesh in self._declared_meshes:
            if tuple(mesh.mesh_dim_names or ()) == meta.mesh_dim_names:
                return mesh
        if self._get_mesh is not None:
            return self._get_mesh(meta.mesh_dim_names, None)
        for p in self.submod.parameters():
            if isinstance(p, DTensor) and (
                tuple(p.device_mesh.mesh_dim_names or ()) == meta.mesh_dim_names
            ):
                return p.device_mesh
        raise ValueError(
            f"stage {self.stage_index} received a DTensor on a mesh with dims "
            f"{meta.mesh_dim_names} but has no such mesh: declare input_args as DTensors, pass "
            "get_mesh, or give the submodule DTensor parameters on that mesh"
        )

    def set_local_inputs(self, mb: int, outputs: tuple[Any, ...]) -> None:
        """Take the previous stage's outputs (same rank) as micro-batch ``mb``'s inputs."""
        self._state(mb).inputs = tuple(
            o.detach().requires_grad_(o.requires_grad) if isinstance(o, torch.Tensor) else o
            for o in outputs
        )

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        """Run the submodule on micro-batch ``fwd_chunk_id`` and keep what backward needs.

        Args:
            fwd_chunk_id: Micro-batch index.
            args: The step's arguments for this micro-batch (first stage only; other stages
                use what they received).
            kwargs: Keyword arguments for this micro-batch (every stage).
            save_forward_output: Whether the last stage keeps the output for the step to
                merge and return (it also needs the schedule's ``return_outputs``).

        Returns:
            The submodule's output.

        See Also:
            :pt:`torch.distributed.pipelining.stage._PipelineStageBase.forward_one_chunk`
        """
        mb = fwd_chunk_id
        state = self._state(mb)
        inputs = args if self.is_first else state.inputs
        if inputs is None:
            raise RuntimeError(
                f"stage {self.stage_index}: forward of micro-batch {mb} has no inputs (the "
                "schedule has no receive or local hand-over before it)"
            )
        output = self._forward_submodule(tuple(inputs), kwargs or {})
        flat = _normalize_output(output)
        state.inputs = None
        state.input_leaves = [
            t
            for t in list(inputs) + list((kwargs or {}).values())
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf
        ]
        state.outputs = flat
        if self.is_last and self.save_forward_output and save_forward_output:
            # Merged for the user after the step; detached so the graph does not outlive backward.
            self.output_chunks[mb] = _detach_output(output)
        return output

    def _forward_submodule(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The submodule's forward on one micro-batch's inputs (a traced stage maps them)."""
        return self.submod(*inputs, **kwargs)

    def outputs_of(self, mb: int) -> tuple[Any, ...]:
        """The flattened outputs of micro-batch ``mb``."""
        outputs = self._state(mb).outputs
        if outputs is None:
            raise RuntimeError(f"stage {self.stage_index} has no forward of micro-batch {mb}")
        return outputs

    def activation_send_parts(self, mb: int) -> list[_Part]:
        """The parts that send micro-batch ``mb``'s outputs to the next stage (the first
        message also carries their description)."""
        outputs = self.outputs_of(mb)
        metas = [_ValueMeta.of(o) for o in outputs]
        dst_stage = self.stage_index + 1
        peer = self._peer(dst_stage)
        ident = (self.stage_index, mb, "F")
        parts: list[_Part] = []
        if self._output_meta is None:
            self._check_declared(metas, self._declared_outputs, "outputs")
            self._output_meta = metas
            meta = _meta_to_tensor(
                [m.to_plain() for m in metas], self.device, f"stage {self.stage_index}"
            )
            parts.append(_Part("send", meta, peer, (*ident, "meta")))
        elif not self.shape_headers and [m.shape for m in metas] != [
            m.shape for m in self._output_meta
        ]:
            raise PipeliningMetadataError(
                f"stage {self.stage_index}, micro-batch {mb}: outputs are "
                f"{[m.describe() for m in metas]} but stage {dst_stage} expects "
                f"{[m.describe() for m in self._output_meta]} and the stages were built with "
                "shape_headers=False (every micro-batch must have the first one's shapes; "
                "build them with shape_headers=True for uneven micro-batches)"
            )
        elif not self._fits(metas):
            raise PipeliningMetadataError(
                f"stage {self.stage_index}, micro-batch {mb}: outputs are "
                f"{[m.describe() for m in metas]} but stage {dst_stage} expects "
                f"{[m.describe() for m in self._output_meta]} (a later micro-batch may be "
                "smaller than the first micro-batch of the first step, as uneven micro-batches "
                "are, but not larger, and kinds, dtypes and ranks must not change)"
            )
        tensors = [_local(o) for o in outputs if isinstance(o, torch.Tensor)]
        capacity = [m.shape for m in self._output_meta if m.kind != "object"]
        header = (
            self._shape_header([tuple(t.shape) for t in tensors]) if self.shape_headers else None
        )
        if header is not None:
            parts.append(_Part("send", header, peer, (*ident, "shape")))
        padded = [_padded(t, shape) for t, shape in zip(tensors, capacity, strict=True)]
        parts += [_Part("send", t, peer, (*ident, f"data{i}")) for i, t in enumerate(padded)]
        objects = [o for o in outputs if not isinstance(o, torch.Tensor)]
        if objects:
            payload = _to_bytes(objects, self.device)
            length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
            parts.append(_Part("send", length, peer, (*ident, "obj_len")))
            parts.append(_Part("send", payload, peer, (*ident, "obj")))
        return parts

    def _shape_header(self, shapes: list[tuple[int, ...]]) -> torch.Tensor | None:
        """The per-message shape header (every tensor's shape, concatenated) as a device
        tensor, made once per distinct set of shapes (no host-to-device copy in a step that
        repeats earlier shapes)."""
        key = tuple(shapes)
        if not any(shapes):
            return None
        cached = self._headers.get(key)
        if cached is None:
            flat = [d for shape in shapes for d in shape]
            cached = torch.tensor(flat, dtype=torch.int64).to(self.device)
            self._headers[key] = cached
        return cached

    def _fits(self, metas: list[_ValueMeta]) -> bool:
        """Whether outputs ``metas`` travel in the buffers the description announced: same
        kinds, dtypes and ranks, no dimension larger (``requires_grad`` may be off under
        ``torch.no_grad``, where the receiver ignores it; DTensor shapes must be equal)."""
        sent = self._output_meta
        assert sent is not None
        if len(metas) != len(sent):
            return False
        for got, want in zip(metas, sent, strict=True):
            if not torch.is_grad_enabled():
                got, want = replace(got, requires_grad=False), replace(want, requires_grad=False)
            if got.kind == "dtensor" or got.kind != want.kind:
                if got != want:
                    return False
                continue
            if (got.dtype, got.requires_grad) != (want.dtype, want.requires_grad):
                return False
            if len(got.shape) != len(want.shape) or any(
                g > w for g, w in zip(got.shape, want.shape, strict=True)
            ):
                return False
        return True

    def _check_declared(
        self, metas: list[_ValueMeta], declared: list[_ValueMeta] | None, what: str
    ) -> None:
        if declared is None:
            return
        got = [(m.kind, m.shape, m.dtype) for m in metas]
        want = [(m.kind, m.shape, m.dtype) for m in declared]
        if got != want:
            raise PipeliningMetadataError(
                f"stage {self.stage_index}: declared {what} are {[m.describe() for m in declared]}"
                f" but the pipeline has {[m.describe() for m in metas]}"
            )

    # -- backward ---------------------------------------------------------------------------

    def _grad_outputs(self, mb: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The tensors backward starts from and their incoming gradients."""
        state = self._state(mb)
        if self.is_last:
            if state.loss is None:
                raise RuntimeError(
                    f"stage {self.stage_index}: backward of micro-batch {mb} without a loss"
                )
            return [state.loss], [None]
        if state.output_grads is None:
            raise RuntimeError(
                f"stage {self.stage_index}: backward of micro-batch {mb} has no output gradients "
                "(the schedule has no receive or local hand-over before it)"
            )
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        for out, grad in zip(self.outputs_of(mb), state.output_grads, strict=True):
            if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None:
                roots.append(out)
                grads.append(grad)
        return roots, grads

    def set_loss(self, mb: int, loss: torch.Tensor) -> None:
        """Record the loss of micro-batch ``mb`` (last stage)."""
        self._state(mb).loss = loss

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: torch.Tensor | None = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        """Backward of micro-batch ``bwd_chunk_id``: all gradients, or
        (``full_backward=False``) only the gradients of the inputs, leaving the weight
        gradients to :meth:`backward_weight_one_chunk`.

        The input-only backward splits the graph once (see :mod:`hp_pp._backward`): it
        computes the input gradients and records the gradients arriving at every node that
        feeds a weight, so the weight pass starts there and never walks the activation chain
        again (FLOPs of input + weight = one full backward).

        Args:
            bwd_chunk_id: Micro-batch index.
            loss: The micro-batch's loss (last stage; default: the one its forward recorded).
            full_backward: ``False``: input gradients only.
            last_backward: ``True`` marks the stage's last backward of the step, so an FSDP
                submodule reduces its gradients in it (the schedules mark it themselves).

        See Also:
            :pt:`torch.distributed.pipelining.stage._PipelineStageBase.backward_one_chunk`
        """
        mb = bwd_chunk_id
        if last_backward and self.fsdp is not None:
            self.fsdp.set_last_backward(True)
        if loss is not None:
            self.set_loss(mb, loss)
        state = self._state(mb)
        roots, grads = self._grad_outputs(mb)
        leaves = state.input_leaves
        if full_backward or self.dw_builder is not None:
            if roots:
                torch.autograd.backward(roots, grads)
            state.input_grads = [t.grad for t in leaves]
            for t in leaves:
                t.grad = None
            if self.dw_builder is not None:
                runner = self.dw_builder()
                if full_backward:
                    runner()
                else:
                    state.dw_runner = runner
                    state.weight_pending = True
            self._release(mb, keep_for_weight=False)
            return
        if roots:
            # An FSDP module reduces in the hooks it put on its outputs: keep them (and the
            # graph) until the weight pass, which ends with a pass that reaches those hooks.
            state.input_grads, state.weight_pass = backward_input(
                roots, grads, leaves, keep_graph=self.fsdp is not None
            )
        else:
            state.input_grads = [None] * len(leaves)
        state.weight_pending = True
        if self.fsdp is None:
            cut_from_graph([*roots, *(state.outputs or ())])
        self._release(mb, keep_for_weight=self.fsdp is not None)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """Weight gradients of micro-batch ``bwd_chunk_id`` (after a backward-input),
        accumulated into the parameters' ``.grad``, from the gradients the backward-input
        recorded.

        Args:
            bwd_chunk_id: Micro-batch index.
            last_backward: ``True`` marks the stage's last weight pass of the step (an FSDP
                submodule reduces its gradients in it; the schedules mark it themselves).

        Raises:
            RuntimeError: no ``backward_one_chunk(..., full_backward=False)`` of this
                micro-batch before it.

        See Also:
            :pt:`torch.distributed.pipelining.stage._PipelineStageBase.backward_weight_one_chunk`
        """
        mb = bwd_chunk_id
        if last_backward and self.fsdp is not None:
            self.fsdp.set_last_backward(True)
        state = self._state(mb)
        if not state.weight_pending:
            raise RuntimeError(
                f"stage {self.stage_index}: backward-weight of micro-batch {mb} without a "
                "backward-input before it"
            )
        state.weight_pending = False
        if state.dw_runner is not None:
            runner, state.dw_runner = state.dw_runner, None
            runner()
            return
        weight_pass, state.weight_pass = state.weight_pass, None
        if weight_pass is not None:
            weight_pass.run()
            del weight_pass
        if self.fsdp is not None:
            self._reach_output_hooks(mb)
            roots, _ = self._grad_outputs(mb)
            cut_from_graph([*roots, *(state.outputs or ())])
        self._release(mb, keep_for_weight=False)

    def _reach_output_hooks(self, mb: int) -> None:
        """Run the hooks on the submodule's outputs (an FSDP module's pre-backward hook,
        which queues its post-backward: gradient accumulation, reshard, reduce-scatter)
        without computing anything on the activation chain: the gradients are captured at
        the outputs themselves."""
        state = self._state(mb)
        if state.outputs is None:
            return
        roots, grads = self._grad_outputs(mb)
        outputs = [o for o in state.outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if roots and outputs:
            torch.autograd.grad(roots, outputs, grads, allow_unused=True)

    def _release(self, mb: int, *, keep_for_weight: bool) -> None:
        """Drop what backward of micro-batch ``mb`` no longer needs; ``keep_for_weight``
        keeps the outputs, their gradients and the loss for the weight pass."""
        state = self._state(mb)
        state.input_leaves = []
        if keep_for_weight:
            return
        state.output_grads = None
        state.loss = None
        # The merged output of the last stage is kept (detached) in ``output_chunks``.
        state.outputs = None

    def input_grads_of(self, mb: int) -> list[torch.Tensor | None]:
        """The gradients of micro-batch ``mb``'s inputs computed by backward."""
        grads = self._state(mb).input_grads
        if grads is None:
            raise RuntimeError(f"stage {self.stage_index} has no backward of micro-batch {mb}")
        return grads

    def set_local_output_grads(self, mb: int, grads: list[torch.Tensor | None]) -> None:
        """Take the next stage's input gradients (same rank) as micro-batch ``mb``'s output
        gradients."""
        outputs = self.outputs_of(mb)
        it = iter(grads)
        self._state(mb).output_grads = [
            next(it) if isinstance(o, torch.Tensor) and o.requires_grad else None for o in outputs
        ]

    def grad_send_parts(self, mb: int) -> list[_Part]:
        """The parts that send micro-batch ``mb``'s input gradients to the previous stage
        (the gradients are dropped here once handed on)."""
        assert self._input_meta is not None
        grads = iter(self.input_grads_of(mb))
        shapes = iter(self._state(mb).input_shapes or [])
        tensors: list[torch.Tensor] = []
        for meta in self._input_meta:
            if not meta.carries_grad:
                continue
            grad = next(grads)
            shape = next(shapes, meta.shape)
            if grad is None:
                grad = torch.zeros(shape, dtype=_dtype_from_name(meta.dtype), device=self.device)
            elif isinstance(grad, DTensor):
                placements = [_placement_from_spec(p) for p in meta.placements]
                grad = grad.redistribute(placements=placements).to_local()
            tensors.append(grad.contiguous())
        peer = self._peer(self.stage_index - 1)
        self.drop_input_grads(mb)
        return [
            _Part("send", t, peer, (self.stage_index, mb, "B", f"data{i}"))
            for i, t in enumerate(tensors)
        ]

    def drop_input_grads(self, mb: int) -> None:
        """Forget micro-batch ``mb``'s input gradients once they were handed on."""
        self._state(mb).input_grads = None

    def grad_recv_parts(self, mb: int) -> list[_Part]:
        """The receives of micro-batch ``mb``'s output gradients from the next stage (their
        buffers take the shapes of this stage's outputs of ``mb``)."""
        outputs = self.outputs_of(mb)
        src_stage = self.stage_index + 1
        peer = self._peer(src_stage)
        pending = self._recv_bwd.setdefault(mb, _PendingRecv())
        for o in outputs:
            if isinstance(o, torch.Tensor) and o.requires_grad:
                pending.buffers.append(
                    torch.empty(_local(o).shape, dtype=o.dtype, device=self.device)
                )
        pending.parts = [
            _Part("recv", b, peer, (src_stage, mb, "B", f"data{i}"))
            for i, b in enumerate(pending.buffers)
        ]
        return list(pending.parts)

    def has_posted_recv_grads(self, mb: int) -> bool:
        """Whether the receives of micro-batch ``mb``'s output gradients are posted."""
        return mb in self._recv_bwd

    def take_received_grads(self, mb: int) -> None:
        """Make the received gradients micro-batch ``mb``'s output gradients (after the
        wait)."""
        pending = self._recv_bwd.pop(mb)
        buffers = iter(pending.buffers)
        grads: list[torch.Tensor | None] = []
        for out in self.outputs_of(mb):
            if not (isinstance(out, torch.Tensor) and out.requires_grad):
                grads.append(None)
                continue
            buf = next(buffers)
            if isinstance(out, DTensor):
                grads.append(
                    DTensor.from_local(
                        buf,
                        out.device_mesh,
                        out.placements,
                        run_check=False,
                        shape=out.shape,
                        stride=out.stride(),
                    )
                )
            else:
                grads.append(buf)
        self._state(mb).output_grads = grads

    # -- after backward ---------------------------------------------------------------------

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide the submodule's gradients by ``grad_scale_factor`` (no-op for 1)."""
        if grad_scale_factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)
