"""The one executor: runs a rank's list of actions over the stages that rank holds.

The executor never knows which schedule it runs; it interprets actions:

- ``F``: forward of one micro-batch (the loss too, on the last stage); ``B``: full backward;
  ``I``: backward for the inputs; ``W``: backward for the weights; ``OVERLAP_F_B``: its
  sub-actions, with the receives of all of them posted before the first one computes.
- ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``: point-to-point transfers, non-blocking; a
  compute action waits for the receives it needs.
- ``PRE_F``/``PRE_B``/``SEND_PRE``/``RECV_PRE``: MPipe's transposed preprocess (see
  :class:`TransposedPreprocess`).
- ``UNSHARD``/``RESHARD``: an FSDP stage module's ``unshard()``/``reshard()``;
  ``REDUCE_GRAD``: a marker (the reduction itself runs in the stage's last backward, see
  :mod:`hp_pp._fsdp_protocol`).

A table with transfer actions is run as written (a compute action whose receive was not posted
raises). A compute-only table (what the generators produce) gets its transfers implicitly:
activations and gradients are sent as soon as they are computed, and the receives of the next
compute actions are posted ahead (``lookahead``), so the transfer of one micro-batch is in
flight while another micro-batch computes (HyperParallel's compute/communication overlap). Only
the very first receive of a stage on the first step blocks where it is posted (it reads the
description of what the previous stage sends). Stages on the same rank hand tensors over
without communication.

The executor records the order in which it posts, waits and computes in :attr:`events`
(``("post_recv_f", stage, mb)``, ``("wait_recv_f", ...)``, ``("F", ...)``, ...), so tests can
observe issue/wait order.

See Also:
    :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_pp.actions import Action, ActionType
from hp_pp.stage import PipelineStage

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
        """Copy the block's parameters and buffers from stage 0's rank to every copy."""
        src = (
            self.owner_group_rank
            if group is None
            else dist.get_global_rank(group, self.owner_group_rank)
        )
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor.data, src, group=group)

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

    def ship(self, stage: PipelineStage, mb: int) -> None:
        """``SEND_PRE``: send micro-batch ``mb``'s output to stage 0's rank."""
        stage.send_preprocess_output(mb, self._outputs.pop(mb), 0)

    def receive(self, stage: PipelineStage, mb: int) -> None:
        """``RECV_PRE`` (stage 0's rank): receive micro-batch ``mb``'s output."""
        if mb not in self._outputs:
            self._outputs[mb] = stage.recv_preprocess_output(mb, self.runner_of[mb])

    @contextlib.contextmanager
    def shipped(self, stage: PipelineStage, mb: int) -> Iterator[None]:
        """During stage 0's forward of ``mb``: the block returns the shipped output."""
        self.receive(stage, mb)
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


class PipelineExecutor:
    """Runs one rank's action list.

    Args:
        stages: The stages this rank holds.
        actions: This rank's actions in order (``None`` entries are idle slots).
        lookahead: For compute-only tables: how many compute actions ahead to post receives.
        preprocess: MPipe's transposed preprocess block, when the table has ``PRE_*`` actions.

    Raises:
        ValueError: an action names a stage this rank does not hold.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`
    """

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        actions: Sequence[Action | None],
        *,
        lookahead: int = 1,
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
        self.explicit_comm = any(a.type.is_communication for a in self.actions)
        self.lookahead = lookahead
        self.events: list[tuple[str, int, int]] = []
        self._compute = [a for a in _flat(self.actions) if a.type.is_compute]
        # The last weight-gradient action of each stage: FSDP reduces there.
        self._last_weight_action: dict[int, int] = {}
        for pos, a in enumerate(self._compute):
            if a.type in (_B, _W):
                self._last_weight_action[a.stage_index] = pos
        self._tie_shapes: dict[str, tuple[tuple[int, ...], str]] | None = None

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
        actions = self.actions if backward else self._forward_only(self.actions)
        compute = self._compute if backward else [a for a in self._compute if a.type is _F]
        pos = 0
        for action in actions:
            if action.type.is_compute or action.type is ActionType.OVERLAP_F_B:
                subs = action.sub_actions or (action,)
                if not self.explicit_comm:
                    # Receives of this action's compute, then of the next few (posted ahead so
                    # they are in flight while this action computes).
                    for sub in subs:
                        self._post_recv(sub, block=True)
                    for ahead in compute[pos + len(subs) : pos + len(subs) + self.lookahead]:
                        self._post_recv(ahead, block=False)
                for sub in subs:
                    self._run_compute(sub, pos)
                    pos += 1
                for stage in self.stages.values():
                    stage.reap_sends()
            else:
                self._run_other(action)
        for stage in self.stages.values():
            stage.wait_sends()
        return self._losses

    @staticmethod
    def _forward_only(actions: list[Action]) -> list[Action]:
        keep = {
            _F,
            ActionType.SEND_F,
            ActionType.RECV_F,
            ActionType.UNSHARD,
            ActionType.RESHARD,
            ActionType.PREPROCESS_F,
            ActionType.SEND_PRE,
            ActionType.RECV_PRE,
        }
        out: list[Action] = []
        for a in actions:
            if a.sub_actions is not None:
                out += [s for s in a.sub_actions if s.type is _F]
            elif a.type in keep:
                out.append(a)
        return out

    # -- transfers --------------------------------------------------------------------------

    def _post_recv(self, action: Action, *, block: bool) -> None:
        stage = self.stages[action.stage_index]
        mb = action.microbatch_index
        assert mb is not None
        if action.type is _F:
            if stage.is_first or stage.is_local(stage.stage_index - 1):
                return
            if stage.has_posted_recv_activations(mb):
                return
            if not block and not stage.knows_input_meta:
                return
            self.events.append(("post_recv_f", stage.stage_index, mb))
            stage.post_recv_activations(mb)
        elif action.type in (_B, _I):
            if stage.is_last or stage.is_local(stage.stage_index + 1):
                return
            if stage.has_posted_recv_grads(mb) or stage._state(mb).output_grads is not None:
                return
            if stage._state(mb).outputs is None:
                return  # its forward has not run yet; posted when it comes closer
            self.events.append(("post_recv_b", stage.stage_index, mb))
            stage.post_recv_grads(mb)

    def _run_preprocess(self, action: Action) -> None:
        pre = self.preprocess
        mb = action.microbatch_index
        assert pre is not None
        assert mb is not None
        kind = action.type
        any_stage = next(iter(self.stages.values()))
        self.events.append((kind.value, action.stage_index, mb))
        if kind is ActionType.PREPROCESS_F:
            pre.forward(mb, self._args[mb], self._kwargs[mb])
            if not self.explicit_comm and 0 not in self.stages:
                pre.ship(any_stage, mb)
        elif kind is ActionType.SEND_PRE:
            pre.ship(any_stage, mb)
        elif kind is ActionType.RECV_PRE:
            pre.receive(self.stages[0], mb)
        elif self._backward:  # PRE_B
            pre.backward(mb, self._args[mb], self._kwargs[mb])

    def _run_other(self, action: Action) -> None:
        if action.type in _PRE_KINDS:
            self._run_preprocess(action)
            return
        stage = self.stages[action.stage_index]
        mb = action.microbatch_index
        kind = action.type
        if kind is ActionType.SEND_F:
            assert mb is not None
            self.events.append(("send_f", stage.stage_index, mb))
            stage.send_activations(mb)
        elif kind is ActionType.SEND_B:
            assert mb is not None
            self.events.append(("send_b", stage.stage_index, mb))
            stage.send_grads(mb)
        elif kind is ActionType.RECV_F:
            assert mb is not None
            self.events.append(("post_recv_f", stage.stage_index, mb))
            stage.post_recv_activations(mb)
        elif kind is ActionType.RECV_B:
            assert mb is not None
            self.events.append(("post_recv_b", stage.stage_index, mb))
            stage.post_recv_grads(mb)
        elif kind is ActionType.UNSHARD:
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
                stage.wait_recv_activations(mb)
            self.events.append(("F", s, mb))
            args = self._args[mb] if stage.is_first else ()
            pre = self.preprocess
            if stage.is_first and pre is not None and mb in pre.runner_of:
                with pre.shipped(stage, mb):
                    output = stage.forward_one_chunk(mb, args, self._kwargs[mb])
            else:
                output = stage.forward_one_chunk(mb, args, self._kwargs[mb])
            if stage.is_last:
                self._maybe_loss(stage, mb, output)
            elif stage.is_local(s + 1):
                self.stages[s + 1].set_local_inputs(mb, stage.outputs_of(mb))
            elif not self.explicit_comm:
                self.events.append(("send_f", s, mb))
                stage.send_activations(mb)
            return
        if not self._backward:
            return
        if action.type in (_B, _I):
            if not stage.is_last and not stage.is_local(s + 1):
                if not stage.has_posted_recv_grads(mb):
                    if stage._state(mb).output_grads is None:
                        raise ValueError(
                            f"action {action}: stage {s} backward of micro-batch {mb} has no "
                            f"{s}RECV_B{mb} before it in the table"
                        )
                else:
                    self.events.append(("wait_recv_b", s, mb))
                    stage.wait_recv_grads(mb)
            if stage.fsdp is not None:
                stage.fsdp.set_last_backward(self._last_weight_action.get(s) == pos)
            self.events.append((action.type.value, s, mb))
            stage.backward_one_chunk(mb, full_backward=action.type is _B)
            if not stage.is_first:
                if stage.is_local(s - 1):
                    self.stages[s - 1].set_local_output_grads(mb, stage.input_grads_of(mb))
                    stage.drop_input_grads(mb)
                elif not self.explicit_comm:
                    self.events.append(("send_b", s, mb))
                    stage.send_grads(mb)
            return
        if action.type is _W:
            if stage.fsdp is not None:
                stage.fsdp.set_last_backward(self._last_weight_action.get(s) == pos)
            self.events.append(("W", s, mb))
            stage.backward_weight_one_chunk(mb)

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

    # -- after the step ---------------------------------------------------------------------

    def sum_tied_grads(self, group: dist.ProcessGroup | None) -> None:
        """Sum the gradients of parameters tied across stages (see :class:`PipelineStage`)."""
        local: dict[str, list[torch.Tensor]] = {}
        for stage in self.stages.values():
            params = dict(stage.submod.named_parameters())
            for fqn, tie in stage.tied_parameters.items():
                local.setdefault(tie, []).append(params[fqn])
        if self._tie_shapes is None:
            mine = {tie: (tuple(ps[0].shape), str(ps[0].dtype)) for tie, ps in local.items()}
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
            shapes: dict[str, tuple[tuple[int, ...], str]] = {}
            for entry in gathered:
                shapes.update(entry)
            self._tie_shapes = shapes
        for tie in sorted(self._tie_shapes):
            shape, dtype = self._tie_shapes[tie]
            total = torch.zeros(
                shape,
                dtype=getattr(torch, dtype.removeprefix("torch.")),
                device=next(iter(self.stages.values())).device,
            )
            for param in local.get(tie, []):
                if param.grad is not None:
                    total += param.grad
            dist.all_reduce(total, group=group)
            for stage in self.stages.values():
                params = dict(stage.submod.named_parameters())
                for fqn, t in stage.tied_parameters.items():
                    if t == tie:
                        params[fqn].grad = total.clone()
