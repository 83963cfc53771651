"""One pipeline stage: a submodule, its per-micro-batch state, and its point-to-point transfers.

A stage runs its submodule on one micro-batch at a time and keeps what backward needs (inputs
and outputs per micro-batch). Between stages on different ranks, activations and gradients move
with ``dist.isend``/``dist.irecv`` (gloo, nccl, hccl); every batch of transfers goes one way, so
they are posted one by one: ``batch_isend_irecv``'s coalescing context only adds a backend
look-up per call (as in torch's schedules, which skip it for one-way batches).

What moves between two stages is described once, on the first step: the sending stage sends a small
description of its outputs (shape, dtype, ``requires_grad``, DTensor placements, which outputs are
not tensors); the receiving stage allocates its buffers from it and checks it against ``input_args``
when those were declared. Later steps reuse the description; a stage whose outputs change shape
raises ``ValueError`` before sending. Descriptions and non-tensor outputs travel as ``torch.save``
bytes read back with ``weights_only=True`` (plain Python values only).

Every transfer has its own tag (stage, micro-batch, direction), so on gloo a receive matches its
send whatever order the two ranks post them in.

Tied parameters (an embedding on the first stage and the output head on the last sharing one
weight): give each stage ``tied_parameters={"<fqn in this submodule>": "<tie name>"}``; after
the backward of a step, the gradients of all parameters with one tie name are summed across the
pipeline group (one all-reduce per tie name over the group; ranks without it add zeros), so
each copy receives the gradient of the shared weight.

See Also:
    :pt:`torch.distributed.pipelining.PipelineStage`
"""

from __future__ import annotations

import datetime
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from hp_pp._backward import WeightPass, backward_input
from hp_pp._fsdp_protocol import FSDPControl

__all__ = ["PipelineStage"]

# Parts of one transfer, folded into its tag.
_PART_DATA, _PART_OBJ_LEN, _PART_OBJ, _PART_META_LEN, _PART_META = range(5)
_KIND_ACT, _KIND_GRAD, _KIND_PRE = 0, 1, 2


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


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


@dataclass
class _PendingRecv:
    """Posted receives of one micro-batch: wait on them, then read the values."""

    works: list[Any]
    buffers: list[torch.Tensor]
    object_len: torch.Tensor | None = None
    object_tag: int = 0
    peer: int = 0


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
    ) -> None:
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
        self._sends: list[tuple[Any, list[torch.Tensor], int]] = []
        self.output_chunks: dict[int, Any] = {}

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

    def _tag(self, kind: int, sender_stage: int, mb: int, part: int) -> int:
        return (((mb * self.num_stages + sender_stage) * 3 + kind) * 5 + part) + 1

    def is_local(self, stage_index: int) -> bool:
        """Whether ``stage_index`` runs on this rank."""
        return self.stage_to_group_rank[stage_index] == self.group_rank

    # -- step bookkeeping -------------------------------------------------------------------

    def clear_runtime_states(self) -> None:
        """Drop the per-micro-batch state of the last step (sends must have completed)."""
        self._mb.clear()
        self._recv_fwd.clear()
        self._recv_bwd.clear()
        self.output_chunks.clear()

    def _state(self, mb: int) -> _MicrobatchState:
        return self._mb.setdefault(mb, _MicrobatchState())

    def wait_sends(self) -> None:
        """Wait until every send this stage issued has completed."""
        sends, self._sends = self._sends, []
        for work, _keepalive, peer in sends:
            self._wait(work, "a send", peer)

    def reap_sends(self) -> None:
        """Forget completed sends, so their tensors can be freed before the step ends.

        nccl/hccl report completion as it happens; gloo only once a send was waited for (its
        sends are waited at the end of the step: waiting earlier could block on a receiver that
        has not posted its receive yet).
        """
        if self._sends:
            self._sends = [entry for entry in self._sends if not entry[0].is_completed()]

    def _wait(self, work: Any, what: str, peer: int) -> None:
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(self.timeout)
        except RuntimeError as err:
            raise RuntimeError(
                f"rank {dist.get_rank()}, stage {self.stage_index}: {what} with rank {peer} did "
                f"not complete ({err})"
            ) from err

    # -- low-level messages -----------------------------------------------------------------

    def _isend(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        if not tensors:
            return
        for t in tensors:
            work = dist.isend(t, peer, self.group, tag)
            assert work is not None  # this rank is in the group
            self._sends.append((work, tensors, peer))

    def _irecv(self, buffers: list[torch.Tensor], peer: int, tag: int) -> list[Any]:
        works = []
        for b in buffers:
            work = dist.irecv(b, peer, self.group, tag)
            assert work is not None  # this rank is in the group
            works.append(work)
        return works

    def _send_object(self, obj: Any, peer: int, tag_len: int, tag_obj: int) -> None:
        payload = _to_bytes(obj)
        self._isend([torch.tensor([payload.numel()], dtype=torch.int64)], peer, tag_len)
        self._isend([payload], peer, tag_obj)

    def _recv_blocking(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
        self._wait(dist.irecv(tensor, peer, self.group, tag), what, peer)

    def _recv_object_blocking(self, peer: int, tag_len: int, tag_obj: int, what: str) -> Any:
        length = torch.zeros(1, dtype=torch.int64)
        self._recv_blocking(length, peer, tag_len, what)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._recv_blocking(payload, peer, tag_obj, what)
        return _from_bytes(payload)

    # -- MPipe's transposed preprocess -------------------------------------------------------

    def send_preprocess_output(self, mb: int, output: torch.Tensor, to_stage: int) -> None:
        """Ship a preprocess output of micro-batch ``mb`` to the rank of ``to_stage``."""
        self._send_object(
            output.detach(),
            self._peer(to_stage),
            self._tag(_KIND_PRE, to_stage, mb, _PART_OBJ_LEN),
            self._tag(_KIND_PRE, to_stage, mb, _PART_OBJ),
        )

    def recv_preprocess_output(self, mb: int, from_group_rank: int) -> torch.Tensor:
        """Receive the preprocess output of micro-batch ``mb`` computed by another rank."""
        peer = (
            from_group_rank
            if self.group is None
            else dist.get_global_rank(self.group, from_group_rank)
        )
        value = self._recv_object_blocking(
            peer,
            self._tag(_KIND_PRE, self.stage_index, mb, _PART_OBJ_LEN),
            self._tag(_KIND_PRE, self.stage_index, mb, _PART_OBJ),
            f"receiving micro-batch {mb}'s preprocess output",
        )
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"micro-batch {mb}'s preprocess output is not a tensor: {value!r}")
        return value.to(self.device)

    # -- forward ----------------------------------------------------------------------------

    @property
    def knows_input_meta(self) -> bool:
        """Whether this stage's input description has arrived (receives post without blocking)."""
        return self._input_meta is not None

    def post_recv_activations(self, mb: int) -> None:
        """Post the receives of micro-batch ``mb``'s inputs from the previous stage.

        On the first step this first waits for the previous stage's output description.
        """
        if mb in self._recv_fwd or self.is_first:
            return
        src_stage = self.stage_index - 1
        peer = self._peer(src_stage)
        if self._input_meta is None:
            plain = self._recv_object_blocking(
                peer,
                self._tag(_KIND_ACT, src_stage, 0, _PART_META_LEN),
                self._tag(_KIND_ACT, src_stage, 0, _PART_META),
                f"receiving the description of stage {src_stage}'s outputs",
            )
            metas = [_ValueMeta.from_plain(p) for p in plain]
            self._check_declared(metas, self._declared_inputs, "inputs")
            self._input_meta = metas
        buffers = [
            torch.empty(m.shape, dtype=_dtype_from_name(m.dtype), device=self.device)
            for m in self._input_meta
            if m.kind != "object"
        ]
        tag = self._tag(_KIND_ACT, src_stage, mb, _PART_DATA)
        pending = _PendingRecv(self._irecv(buffers, peer, tag), buffers, peer=peer)
        if any(m.kind == "object" for m in self._input_meta):
            pending.object_len = torch.zeros(1, dtype=torch.int64)
            pending.works += self._irecv(
                [pending.object_len], peer, self._tag(_KIND_ACT, src_stage, mb, _PART_OBJ_LEN)
            )
            pending.object_tag = self._tag(_KIND_ACT, src_stage, mb, _PART_OBJ)
        self._recv_fwd[mb] = pending

    def has_posted_recv_activations(self, mb: int) -> bool:
        """Whether the receives of micro-batch ``mb``'s inputs are posted."""
        return mb in self._recv_fwd

    def wait_recv_activations(self, mb: int) -> None:
        """Wait for micro-batch ``mb``'s inputs and make them this stage's inputs."""
        pending = self._recv_fwd.pop(mb)
        for work in pending.works:
            self._wait(work, f"receiving micro-batch {mb}'s activations", pending.peer)
        assert self._input_meta is not None
        objects: list[Any] = []
        if pending.object_len is not None:
            payload = torch.empty(int(pending.object_len.item()), dtype=torch.uint8)
            self._recv_blocking(
                payload, pending.peer, pending.object_tag, f"receiving micro-batch {mb}'s values"
            )
            objects = list(_from_bytes(payload))
        tensors = iter(pending.buffers)
        objs = iter(objects)
        values: list[Any] = []
        for meta in self._input_meta:
            if meta.kind == "object":
                values.append(next(objs))
                continue
            buf = next(tensors)
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
        self._state(mb).inputs = tuple(values)

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
        self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run the submodule on micro-batch ``mb`` and keep what backward needs.

        Args:
            mb: Micro-batch index.
            args: The step's arguments for this micro-batch (first stage only; other stages
                use what they received).
            kwargs: Keyword arguments for this micro-batch (every stage).

        Returns:
            The submodule's output.
        """
        state = self._state(mb)
        inputs = args if self.is_first else state.inputs
        if inputs is None:
            raise RuntimeError(
                f"stage {self.stage_index}: forward of micro-batch {mb} has no inputs (the "
                "schedule has no receive or local hand-over before it)"
            )
        output = self.submod(*inputs, **(kwargs or {}))
        flat = _normalize_output(output)
        state.inputs = None
        state.input_leaves = [
            t
            for t in list(inputs) + list((kwargs or {}).values())
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf
        ]
        state.outputs = flat
        if self.is_last:
            # Merged for the user after the step; detached so the graph does not outlive backward.
            self.output_chunks[mb] = _detach_output(output)
        return output

    def outputs_of(self, mb: int) -> tuple[Any, ...]:
        """The flattened outputs of micro-batch ``mb``."""
        outputs = self._state(mb).outputs
        if outputs is None:
            raise RuntimeError(f"stage {self.stage_index} has no forward of micro-batch {mb}")
        return outputs

    def send_activations(self, mb: int) -> None:
        """Send micro-batch ``mb``'s outputs to the next stage (non-blocking)."""
        outputs = self.outputs_of(mb)
        metas = [_ValueMeta.of(o) for o in outputs]
        dst_stage = self.stage_index + 1
        peer = self._peer(dst_stage)
        if self._output_meta is None:
            self._check_declared(metas, self._declared_outputs, "outputs")
            self._output_meta = metas
            self._send_object(
                [m.to_plain() for m in metas],
                peer,
                self._tag(_KIND_ACT, self.stage_index, 0, _PART_META_LEN),
                self._tag(_KIND_ACT, self.stage_index, 0, _PART_META),
            )
        elif metas != self._output_meta and not self._same_without_autograd(metas):
            raise ValueError(
                f"stage {self.stage_index}, micro-batch {mb}: outputs are "
                f"{[m.describe() for m in metas]} but stage {dst_stage} expects "
                f"{[m.describe() for m in self._output_meta]} (shapes must not change between "
                "steps)"
            )
        tensors = [_local(o) for o in outputs if isinstance(o, torch.Tensor)]
        self._isend(tensors, peer, self._tag(_KIND_ACT, self.stage_index, mb, _PART_DATA))
        objects = [o for o in outputs if not isinstance(o, torch.Tensor)]
        if objects:
            self._send_object(
                objects,
                peer,
                self._tag(_KIND_ACT, self.stage_index, mb, _PART_OBJ_LEN),
                self._tag(_KIND_ACT, self.stage_index, mb, _PART_OBJ),
            )

    def _same_without_autograd(self, metas: list[_ValueMeta]) -> bool:
        """Whether a forward-only run under ``torch.no_grad`` (``eval``) sends what the step's
        outputs were: its outputs only lack ``requires_grad``, which the receiver ignores there."""
        if torch.is_grad_enabled() or self._output_meta is None:
            return False
        sent = [replace(m, requires_grad=False) for m in self._output_meta]
        return [replace(m, requires_grad=False) for m in metas] == sent

    def _check_declared(
        self, metas: list[_ValueMeta], declared: list[_ValueMeta] | None, what: str
    ) -> None:
        if declared is None:
            return
        got = [(m.kind, m.shape, m.dtype) for m in metas]
        want = [(m.kind, m.shape, m.dtype) for m in declared]
        if got != want:
            raise ValueError(
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
        self, mb: int, loss: torch.Tensor | None = None, full_backward: bool = True
    ) -> None:
        """Backward of micro-batch ``mb``: all gradients, or (``full_backward=False``) only
        the gradients of the inputs, leaving the weight gradients to
        :meth:`backward_weight_one_chunk`.

        The input-only backward splits the graph once (see :mod:`hp_pp._backward`): it
        computes the input gradients and records the gradients arriving at every node that
        feeds a weight, so the weight pass starts there and never walks the activation chain
        again (FLOPs of input + weight = one full backward).
        """
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
        self._release(mb, keep_for_weight=self.fsdp is not None)

    def backward_weight_one_chunk(self, mb: int) -> None:
        """Weight gradients of micro-batch ``mb`` (after a backward-input), accumulated into
        the parameters' ``.grad``, from the gradients the backward-input recorded.
        """
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

    def send_grads(self, mb: int) -> None:
        """Send micro-batch ``mb``'s input gradients to the previous stage (non-blocking)."""
        assert self._input_meta is not None
        grads = iter(self.input_grads_of(mb))
        tensors: list[torch.Tensor] = []
        for meta in self._input_meta:
            if not meta.carries_grad:
                continue
            grad = next(grads)
            if grad is None:
                grad = torch.zeros(
                    meta.shape, dtype=_dtype_from_name(meta.dtype), device=self.device
                )
            elif isinstance(grad, DTensor):
                placements = [_placement_from_spec(p) for p in meta.placements]
                grad = grad.redistribute(placements=placements).to_local()
            tensors.append(grad.contiguous())
        self._isend(
            tensors,
            self._peer(self.stage_index - 1),
            self._tag(_KIND_GRAD, self.stage_index, mb, _PART_DATA),
        )
        self.drop_input_grads(mb)

    def drop_input_grads(self, mb: int) -> None:
        """Forget micro-batch ``mb``'s input gradients once they were handed on."""
        self._state(mb).input_grads = None

    def post_recv_grads(self, mb: int) -> None:
        """Post the receives of micro-batch ``mb``'s output gradients from the next stage."""
        if mb in self._recv_bwd or self.is_last:
            return
        outputs = self.outputs_of(mb)
        buffers = [
            torch.empty(_local(o).shape, dtype=o.dtype, device=self.device)
            for o in outputs
            if isinstance(o, torch.Tensor) and o.requires_grad
        ]
        src_stage = self.stage_index + 1
        peer = self._peer(src_stage)
        tag = self._tag(_KIND_GRAD, src_stage, mb, _PART_DATA)
        self._recv_bwd[mb] = _PendingRecv(self._irecv(buffers, peer, tag), buffers, peer=peer)

    def has_posted_recv_grads(self, mb: int) -> bool:
        """Whether the receives of micro-batch ``mb``'s output gradients are posted."""
        return mb in self._recv_bwd

    def wait_recv_grads(self, mb: int) -> None:
        """Wait for micro-batch ``mb``'s output gradients."""
        pending = self._recv_bwd.pop(mb)
        for work in pending.works:
            self._wait(work, f"receiving micro-batch {mb}'s gradients", pending.peer)
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
