"""The one executor: runs a rank's list of actions over the stages that rank holds.

The executor never knows which schedule it runs; it interprets actions:

- ``F``: forward of one micro-batch (the loss too, on the last stage); ``B``: full backward;
  ``I``: backward for the inputs; ``W``: backward for the weights; ``OVERLAP_F_B``: its
  sub-actions.
- ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``: point-to-point transfers. Transfer actions that
  follow each other with no compute in between are posted as **one batch**
  (``dist.batch_isend_irecv``) in the order written, without tags; a compute action waits for
  the batch holding its receives. This is what NCCL needs (see :mod:`hp_pp.p2p_model`): both
  ranks of a pair post their messages in the same order, and a rank that waits never holds back
  a send its peer needs. The schedule classes give the executor their table lowered with
  :func:`~hp_pp.add_communication` (sends right after the compute that produces them, each
  receive posted as soon as its peer sends it), which the validator checks under NCCL's rules
  before anything runs.
- ``PRE_F``/``PRE_B``/``SEND_PRE``/``RECV_PRE``: MPipe's transposed preprocess (see
  :class:`TransposedPreprocess`).
- ``UNSHARD``/``RESHARD``: an FSDP stage module's ``unshard()``/``reshard()``;
  ``REDUCE_GRAD``: a marker (the reduction itself runs in the stage's last backward, see
  :mod:`hp_pp._fsdp_protocol`).

Stages on the same rank hand tensors over without communication.

The executor records the order in which it posts, waits and computes in :attr:`events`
(``("post_recv_f", stage, mb)``, ``("wait_recv_f", ...)``, ``("F", ...)``, ...), and every
point-to-point operation it posts, with its batch, peer, shape, dtype and identity, in
:attr:`trace` (a program that :func:`hp_pp.p2p_model.replay` checks under NCCL's rules).

See Also:
    :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d
from torch import nn

from hp_pp.actions import Action, ActionType
from hp_pp.p2p_model import P2POp, Post, Wait
from hp_pp.stage import PipelineStage, _Part
from hp_pp.transport import Exchange, Message, plan_rank

__all__ = ["PipelineExecutor", "TransposedPreprocess"]

_F = ActionType.FORWARD
_B = ActionType.FULL_BACKWARD
_I = ActionType.BACKWARD_INPUT
_W = ActionType.BACKWARD_WEIGHT
_PRE_KINDS = frozenset(
    {
        ActionType.PREPROCESS_F,
        ActionType.PREPROCESS_B,
        ActionType.SEND_PRE,
        ActionType.RECV_PRE,
    }
)


def _flat(actions: Sequence[Action]) -> Iterator[Action]:
    for a in actions:
        if a.sub_actions is not None:
            yield from a.sub_actions
        else:
            yield a


def _produced_remote(
    action: Action, placement: dict[int, int], num_stages: int, rank: int
) -> Message | None:
    from hp_pp.transport import produced

    return produced(rank, action, placement, num_stages)


class _Shipped(nn.Module):
    """Stands in for the preprocess block: returns the output computed elsewhere."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.output


class TransposedPreprocess:
    """HyperParallel's MPipe transpose: stage 0's preprocess block, run elsewhere.

    For the transposed micro-batches, the rank named by the table runs the preprocess forward
    (``PRE_F``, no autograd graph) on its copy of the block and ships the output to stage 0's
    rank, whose forward of that micro-batch starts from it (the block is swapped for the
    shipped output during that forward). ``PRE_B`` on stage 0's rank recomputes the block's
    forward from its own copy of the micro-batch's inputs and back-propagates the gradient the
    shipped output received, so the block's gradients accumulate on stage 0 only. Before every
    step the block's parameters are broadcast from stage 0's rank to every copy.

    Args:
        module: This rank's copy of the preprocess block (on stage 0's rank: the submodule of
            stage 0 named ``fqn``).
        fqn: The block's name inside stage 0's submodule.
        owner_group_rank: The pipeline-group rank of stage 0.
        runner_of: ``{micro-batch: group rank}`` of every transposed micro-batch.
        trainable: Whether the block is trained (``PRE_B`` runs); frozen blocks ship outputs
            without gradient.

    See Also:
        HyperParallel's ``ScheduleMPipeTranspose``.
    """

    def __init__(
        self,
        module: nn.Module,
        fqn: str,
        owner_group_rank: int,
        runner_of: dict[int, int],
        *,
        trainable: bool = True,
    ) -> None:
        self.module = module
        self.fqn = fqn
        self.owner_group_rank = owner_group_rank
        self.runner_of = dict(runner_of)
        self.trainable = trainable
        self._outputs: dict[int, torch.Tensor] = {}
        self._leaves: dict[int, torch.Tensor] = {}

    def broadcast_parameters(self, group: dist.ProcessGroup | None) -> None:
        """Copy the block's parameters and buffers from stage 0's rank to every copy: one
        broadcast of one flat bucket per dtype (one collective per step for a block of one
        dtype), on the block's device."""
        src = (
            self.owner_group_rank
            if group is None
            else dist.get_global_rank(group, self.owner_group_rank)
        )
        tensors = [*self.module.parameters(), *self.module.buffers()]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for dtype in sorted(by_dtype, key=str):
                group_tensors = by_dtype[dtype]
                flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
                dist.broadcast(flat, src, group=group)
                offset = 0
                for t in group_tensors:
                    n = t.numel()
                    t.data.copy_(flat[offset : offset + n].view_as(t))
                    offset += n

    def clear(self) -> None:
        self._outputs.clear()
        self._leaves.clear()

    def forward(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """``PRE_F``: the block's output for micro-batch ``mb`` (kept to be shipped)."""
        if not args and not kwargs:
            raise ValueError(
                f"MPipe: this rank runs the preprocess of micro-batch {mb}; pass the model "
                "inputs to step() on it too"
            )
        with torch.no_grad():
            out: torch.Tensor = self.module(*args, **kwargs)
        self._outputs[mb] = out
        return out

    def take_output(self, mb: int) -> torch.Tensor:
        """``SEND_PRE``: micro-batch ``mb``'s output, to be shipped to stage 0's rank."""
        return self._outputs.pop(mb)

    def put_received(self, mb: int, output: torch.Tensor) -> None:
        """``RECV_PRE`` (stage 0's rank): micro-batch ``mb``'s output has arrived."""
        self._outputs[mb] = output

    @contextlib.contextmanager
    def shipped(self, stage: PipelineStage, mb: int) -> Iterator[None]:
        """During stage 0's forward of ``mb``: the block returns the shipped output."""
        if mb not in self._outputs:
            raise RuntimeError(
                f"MPipe: stage 0's forward of micro-batch {mb} before its preprocess output "
                "arrived (the table has no 0RECV_PRE before it)"
            )
        leaf = self._outputs.pop(mb).detach().requires_grad_(self.trainable)
        self._leaves[mb] = leaf
        parent_name, _, child = self.fqn.rpartition(".")
        parent = stage.submod.get_submodule(parent_name) if parent_name else stage.submod
        original = getattr(parent, child)
        setattr(parent, child, _Shipped(leaf))
        try:
            yield
        finally:
            setattr(parent, child, original)

    def backward(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``PRE_B``: recompute the block on ``mb``'s inputs and back-propagate its gradient."""
        leaf = self._leaves.pop(mb)
        if leaf.grad is None:
            raise RuntimeError(f"MPipe: PRE_B of micro-batch {mb} before stage 0's backward of it")
        out = self.module(*args, **kwargs)
        torch.autograd.backward(out, leaf.grad)


class _Batch:
    """One posted batch: its works, its receives and its number.

    The tensors of its sends are not held here: the backend's work keeps them until they are
    sent (as torch's executor relies on), so a gradient already on its way is freed as soon as
    the backend lets it go, not at the end of the step.
    """

    def __init__(self, number: int, works: list[Any], parts: list[_Part]) -> None:
        self.number = number
        self.works = works
        self.parts = [p for p in parts if p.kind == "recv"]
        self.ops = [(p.kind, p.ident, p.peer) for p in parts]
        self.done = False

    def release(self) -> None:
        """Drop the tensors and works once complete (parts point back here: no cycle left)."""
        for part in self.parts:
            part.batch = None
        self.parts = []
        self.works = []


class PipelineExecutor:
    """Runs one rank's action list.

    Args:
        stages: The stages this rank holds.
        actions: This rank's actions in order (``None`` entries are idle slots). Transfers
            between ranks must be written out (``SEND_*``/``RECV_*``, as
            :func:`~hp_pp.add_communication` adds them); the schedule classes do this.
        preprocess: MPipe's transposed preprocess block, when the table has ``PRE_*`` actions.

    Raises:
        ValueError: an action names a stage this rank does not hold, or a compute-only row
            needs transfers with other ranks.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`
    """

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        actions: Sequence[Action | None],
        *,
        preprocess: TransposedPreprocess | None = None,
    ) -> None:
        self.stages = {s.stage_index: s for s in stages}
        self.actions = [a for a in actions if a is not None]
        self.preprocess = preprocess
        for a in _flat(self.actions):
            if a.type in _PRE_KINDS:
                if preprocess is None:
                    raise ValueError(
                        f"action {a} needs MPipe's preprocess block (ScheduleMPipe's "
                        "preprocess_fqn= and, off stage 0's rank, preprocess=)"
                    )
                continue
            if a.stage_index not in self.stages:
                raise ValueError(
                    f"action {a} names stage {a.stage_index}, but this rank holds stages "
                    f"{sorted(self.stages)}"
                )
        self.events: list[tuple[str, int, int]] = []
        #: Point-to-point program of the last step, which :func:`hp_pp.p2p_model.replay`
        #: checks under NCCL's rules.
        self.trace: list[Post | Wait] = []
        self._compute = [a for a in _flat(self.actions) if a.type.is_compute]
        # The last weight-gradient action of each stage: FSDP reduces there.
        self._last_weight_action: dict[int, int] = {}
        for pos, a in enumerate(self._compute):
            if a.type in (_B, _W):
                self._last_weight_action[a.stage_index] = pos
        any_stage = next(iter(self.stages.values()))
        self._group_rank = any_stage.group_rank
        placement = dict(any_stage.stage_to_group_rank)
        row: list[Action | None] = list(self.actions)
        self._plan = plan_rank(
            {self._group_rank: row},
            self._group_rank,
            num_stages=any_stage.num_stages,
            placement=placement,
            preprocess_rank=None if preprocess is None else dict(preprocess.runner_of),
        )
        explicit = any(a.type.is_communication for a in self.actions)
        if not explicit:
            for needs in self._plan.needs.values():
                if needs:
                    raise ValueError(
                        f"rank {self._group_rank}'s actions need transfers from other ranks "
                        f"({needs[0]}) but have no SEND/RECV actions: lower the whole table "
                        "with hp_pp.add_communication first (the schedule classes do)"
                    )
            for a in _flat(self.actions):
                msg = _produced_remote(a, placement, any_stage.num_stages, self._group_rank)
                if msg is not None:
                    raise ValueError(
                        f"rank {self._group_rank}'s action {a} produces {msg} for rank "
                        f"{msg.dst} but the row has no SEND/RECV actions: lower the whole "
                        "table with hp_pp.add_communication first (the schedule classes do)"
                    )
        self._batches: list[_Batch] = []
        self._pending_recv: dict[tuple[str, int, int], list[_Batch]] = {}
        #: ``{action type: fn(action, context)}``: run instead of the built-in work of those
        #: actions (the schedule's ``register_custom_function``).
        self.custom_functions: dict[ActionType, Callable[..., None]] = {}
        #: What a custom function gets as its second argument (set by the schedule per step).
        self.context: Any = None

    @property
    def compute_actions(self) -> list[Action]:
        """This rank's compute actions (``F``, ``B``, ``I``, ``W``) in the order they run."""
        return list(self._compute)

    # -- one step ---------------------------------------------------------------------------

    def run(
        self,
        arg_chunks: list[tuple[Any, ...]],
        kwarg_chunks: list[dict[str, Any]],
        target_chunks: list[Any] | None,
        loss_fn: Callable[..., torch.Tensor] | None,
        *,
        backward: bool,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Run the actions once (one step); returns the last stage's losses by micro-batch."""
        self.events.clear()
        self.trace = []
        self._batches = []
        self._pending_recv = {}
        self._args = arg_chunks
        self._kwargs = kwarg_chunks
        self._targets = target_chunks
        self._loss_fn = loss_fn
        self._loss_kwargs = loss_kwargs or {}
        self._losses: dict[int, torch.Tensor] = {}
        self._backward = backward
        if self.preprocess is not None:
            self.preprocess.clear()
        for stage in self.stages.values():
            stage.clear_runtime_states()
            if backward and stage.fsdp is not None:
                stage.fsdp.set_last_backward(False)
        steps = self._plan.steps if backward else self._forward_only(self._plan.steps)
        pos = 0
        for step in steps:
            if isinstance(step, Exchange):
                self._exchange(step)
            elif step.type is ActionType.OVERLAP_F_B:
                # DualPipeV's overlapped pair: its sub-actions, in order.
                assert step.sub_actions is not None
                custom = self.custom_functions.get(ActionType.OVERLAP_F_B)
                if custom is not None:
                    # The pair's receives are waited for before, its hand-overs done after.
                    for k, sub in enumerate(step.sub_actions):
                        self._before_compute(sub, pos + k)
                    self.events.append(("OVERLAP_F_B", step.stage_index, -1))
                    custom(step, self.context)
                    for sub in step.sub_actions:
                        self._after_compute(sub, None)
                    pos += len(step.sub_actions)
                else:
                    for sub in step.sub_actions:
                        self._run_compute(sub, pos)
                        pos += 1
                self._reap()
            elif step.type.is_compute:
                self._run_compute(step, pos)
                pos += 1
                self._reap()
            else:
                self._run_other(step)
        for batch in self._batches:
            self._wait_batch(batch, "the step's last transfers")
        self._batches = []
        return self._losses

    @staticmethod
    def _forward_only(steps: list[Exchange | Action]) -> list[Exchange | Action]:
        keep = {
            _F,
            ActionType.UNSHARD,
            ActionType.RESHARD,
            ActionType.PREPROCESS_F,
        }
        out: list[Exchange | Action] = []
        for step in steps:
            if isinstance(step, Exchange):
                only = Exchange(
                    sends=[m for m in step.sends if m.what != "B"],
                    recvs=[m for m in step.recvs if m.what != "B"],
                )
                if only:
                    out.append(only)
            elif step.sub_actions is not None:
                out += [s for s in step.sub_actions if s.type is _F]
            elif step.type in keep:
                out.append(step)
        return out

    # -- transfers --------------------------------------------------------------------------

    def _exchange(self, exchange: Exchange) -> None:
        """Post the sends and receives of ``exchange`` as one batch (more than one only when
        a receive's buffers depend on what arrives first: the first step's description)."""
        parts: list[_Part] = []
        for msg in exchange.sends:
            parts += self._send_parts(msg)
        owners: list[tuple[str, int, int]] = []
        for msg in exchange.recvs:
            key = (msg.what, msg.to_stage, msg.mb)
            owners.append(key)
            for round_parts, wait in self._recv_rounds(msg):
                parts += round_parts
                if wait:
                    batch = self._post(parts)
                    self._wait_batch(batch, f"stage {msg.to_stage}: receiving {msg}")
                    parts = []
        self._post(parts)

    def _send_parts(self, msg: Message) -> list[_Part]:
        if msg.what == "PRE":
            pre = self.preprocess
            assert pre is not None
            self.events.append(("send_pre", 0, msg.mb))
            return next(iter(self.stages.values())).preprocess_send_parts(
                msg.mb, pre.take_output(msg.mb)
            )
        stage = self.stages[msg.stage]
        if msg.what == "F":
            self.events.append(("send_f", msg.stage, msg.mb))
            return stage.activation_send_parts(msg.mb)
        self.events.append(("send_b", msg.stage, msg.mb))
        return stage.grad_send_parts(msg.mb)

    def _recv_rounds(self, msg: Message) -> Iterator[tuple[list[_Part], bool]]:
        if msg.what == "PRE":
            stage = self.stages[0]
            self.events.append(("post_recv_pre", 0, msg.mb))
            yield from stage.preprocess_recv_parts(msg.mb, msg.src)
        elif msg.what == "F":
            stage = self.stages[msg.to_stage]
            self.events.append(("post_recv_f", msg.to_stage, msg.mb))
            yield from stage.activation_recv_parts(msg.mb)
        else:
            stage = self.stages[msg.to_stage]
            if not stage.has_forward(msg.mb):
                raise ValueError(
                    f"stage {msg.to_stage}: {msg.to_stage}RECV_B{msg.mb} comes before the "
                    f"forward {msg.to_stage}F{msg.mb} (gradient buffers take the shapes of its "
                    "outputs)"
                )
            self.events.append(("post_recv_b", msg.to_stage, msg.mb))
            yield stage.grad_recv_parts(msg.mb), False

    def _post(self, parts: list[_Part]) -> _Batch | None:
        if not parts:
            return None
        number = len(self.trace)
        ops = []
        for part in parts:
            op = dist.P2POp(
                _c10d.isend if part.kind == "send" else _c10d.irecv,
                part.tensor,
                part.peer,
                self._group,
            )
            ops.append(op)
        works = dist.batch_isend_irecv(ops)
        batch = _Batch(number, list(works), parts)
        for part in parts:
            part.batch = batch
        self.trace.append(
            Post(
                number,
                tuple(
                    P2POp(
                        part.kind,
                        part.peer,
                        part.ident,
                        tuple(part.tensor.shape),
                        str(part.tensor.dtype),
                    )
                    for part in parts
                ),
            )
        )
        self._batches.append(batch)
        return batch

    @property
    def _group(self) -> dist.ProcessGroup | None:
        return next(iter(self.stages.values())).group

    def _wait_batch(self, batch: _Batch | None, what: str) -> None:
        """Wait for every operation of ``batch`` (on NCCL a batch completes as a whole); a
        peer that died or raised makes this rank fail within the stage's timeout, naming the
        transfer and the peer."""
        if batch is None or batch.done:
            return
        self.trace.append(Wait(batch.number))
        stage = next(iter(self.stages.values()))
        peers = sorted({peer for _, _, peer in batch.ops})
        for work in batch.works:
            try:
                if stage.timeout is None:
                    work.wait()
                else:
                    work.wait(stage.timeout)
            except RuntimeError as err:
                ops = ", ".join(
                    f"{kind} {ident[2]}(stage {ident[0]}, mb {ident[1]}, {ident[3]}) "
                    f"with rank {peer}"
                    for kind, ident, peer in batch.ops
                )
                peer_text = " and ".join(f"rank {p}" for p in peers)
                raise RuntimeError(
                    f"rank {dist.get_rank()}, {what} with {peer_text} did not complete (its "
                    f"batch: {ops}) ({err})"
                ) from err
        batch.done = True
        batch.release()

    def _wait_recv(self, what: str, stage: PipelineStage, mb: int) -> None:
        kind = {"F": "activations", "B": "gradients", "PRE": "preprocess output"}[what]
        label = f"stage {stage.stage_index}: receiving micro-batch {mb}'s {kind}"
        for part in stage.received_parts(what, mb):
            self._wait_batch(part.batch, label)

    def _reap(self) -> None:
        """Forget waited or completed batches, so their tensors can be freed before the step
        ends (NCCL reports completion as it happens; gloo only once waited)."""
        keep = []
        for b in self._batches:
            if b.done or all(w.is_completed() for w in b.works):
                b.done = True
                b.release()
            else:
                keep.append(b)
        self._batches = keep

    def _run_preprocess(self, action: Action) -> None:
        pre = self.preprocess
        mb = action.microbatch_index
        assert pre is not None
        assert mb is not None
        kind = action.type
        self.events.append((kind.value, action.stage_index, mb))
        if kind is ActionType.PREPROCESS_F:
            pre.forward(mb, self._args[mb], self._kwargs[mb])
        elif self._backward:  # PRE_B
            pre.backward(mb, self._args[mb], self._kwargs[mb])

    def _run_other(self, action: Action) -> None:
        if action.type in _PRE_KINDS:
            self._run_preprocess(action)
            return
        custom = self.custom_functions.get(action.type)
        if custom is not None:
            self.events.append((action.type.value, action.stage_index, -1))
            custom(action, self.context)
            return
        stage = self.stages[action.stage_index]
        kind = action.type
        if kind is ActionType.UNSHARD:
            if stage.fsdp is not None:
                stage.fsdp.unshard()
        elif kind is ActionType.RESHARD:
            if stage.fsdp is not None:
                stage.fsdp.reshard()
        elif kind is ActionType.REDUCE_GRAD:
            pass  # reduction happens in the stage's last backward (see _fsdp_protocol)
        else:  # pragma: no cover - the vocabulary is closed
            raise ValueError(f"the executor cannot run {action}")

    # -- compute ----------------------------------------------------------------------------

    def _run_compute(self, action: Action, pos: int) -> None:
        if action.type is not _F and not self._backward:
            return
        self._before_compute(action, pos)
        custom = self.custom_functions.get(action.type)
        if custom is not None:
            custom(action, self.context)
            self._after_compute(action, None)
            return
        stage = self.stages[action.stage_index]
        mb = action.microbatch_index
        assert mb is not None
        if action.type is _F:
            args = self._args[mb] if stage.is_first else ()
            pre = self.preprocess
            if stage.is_first and pre is not None and mb in pre.runner_of:
                if stage.received_parts("PRE", mb):
                    self._wait_recv("PRE", stage, mb)
                    pre.put_received(mb, stage.take_received_preprocess(mb))
                with pre.shipped(stage, mb):
                    output = stage.forward_one_chunk(mb, args, self._kwargs[mb])
            else:
                output = stage.forward_one_chunk(mb, args, self._kwargs[mb])
            self._after_compute(action, output)
        elif action.type in (_B, _I):
            stage.backward_one_chunk(mb, full_backward=action.type is _B)
            self._after_compute(action, None)
        elif action.type is _W:
            stage.backward_weight_one_chunk(mb)

    def _before_compute(self, action: Action, pos: int) -> None:
        """Wait for the receives ``action`` needs and mark the stage's last backward."""
        stage = self.stages[action.stage_index]
        mb = action.microbatch_index
        assert mb is not None
        s = stage.stage_index
        if action.type is _F:
            if not stage.is_first and not stage.is_local(s - 1):
                if not stage.has_posted_recv_activations(mb):
                    raise ValueError(
                        f"action {action}: stage {s} forward of micro-batch {mb} has no "
                        f"{s}RECV_F{mb} before it in the table"
                    )
                self.events.append(("wait_recv_f", s, mb))
                self._wait_recv("F", stage, mb)
                stage.take_received_activations(mb)
            self.events.append(("F", s, mb))
            return
        if action.type in (_B, _I) and not stage.is_last and not stage.is_local(s + 1):
            if stage.has_posted_recv_grads(mb):
                self.events.append(("wait_recv_b", s, mb))
                self._wait_recv("B", stage, mb)
                stage.take_received_grads(mb)
            elif not stage.has_output_grads(mb):
                raise ValueError(
                    f"action {action}: stage {s} backward of micro-batch {mb} has no "
                    f"{s}RECV_B{mb} before it in the table"
                )
        if stage.fsdp is not None:
            stage.fsdp.set_last_backward(self._last_weight_action.get(s) == pos)
        self.events.append((action.type.value, s, mb))

    def _after_compute(self, action: Action, output: Any) -> None:
        """Hand ``action``'s results on: a forward's outputs to a next stage on this rank or
        to the loss; a backward's input gradients to a previous stage on this rank."""
        stage = self.stages[action.stage_index]
        mb = action.microbatch_index
        assert mb is not None
        s = stage.stage_index
        if action.type is _F:
            if not stage.has_forward(mb):
                raise RuntimeError(
                    f"action {action}: stage {s} kept no output of micro-batch {mb} (a custom "
                    "forward must run stage.forward_one_chunk or its equivalent)"
                )
            if stage.is_last:
                if output is None:
                    flat = stage.outputs_of(mb)
                    output = flat[0] if len(flat) == 1 else flat
                self._maybe_loss(stage, mb, output)
            elif stage.is_local(s + 1):
                self.stages[s + 1].set_local_inputs(mb, stage.outputs_of(mb))
        elif action.type in (_B, _I) and not stage.is_first and stage.is_local(s - 1):
            self.stages[s - 1].set_local_output_grads(mb, stage.input_grads_of(mb))
            stage.drop_input_grads(mb)

    def _maybe_loss(self, stage: PipelineStage, mb: int, output: Any) -> None:
        if self._loss_fn is None:
            return
        if self._targets is None:
            raise ValueError(
                f"stage {stage.stage_index} is the last stage and has a loss_fn, but step() got "
                "no target"
            )
        loss = self._loss_fn(output, self._targets[mb], **self._loss_kwargs)
        self._losses[mb] = loss.detach()
        if self._backward:
            stage.set_loss(mb, loss)
