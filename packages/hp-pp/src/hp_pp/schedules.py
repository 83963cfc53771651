"""Schedule classes with PyTorch's names and signatures, all running on the one executor.

A schedule class turns the step's batch into micro-batches, takes the action table of its
schedule (from ``hp_pp.generate_schedule``, or any table the user loads with
:meth:`PipelineScheduleRuntime.load_actions` / :meth:`PipelineScheduleRuntime.load_csv`), and
hands this rank's row to a :class:`~hp_pp.executor.PipelineExecutor`. After the backward it sums
tied gradients and divides gradients by ``n_microbatches`` when ``scale_grads`` is set, as
PyTorch does (so a mean-reduced ``loss_fn`` gives the gradients of the full batch).

Bad input raises ``ValueError`` before any communication: sizes a schedule cannot run, stages
that do not sit where the schedule's mapping puts them (e.g. ZBV without the V mapping), a
last stage without ``loss_fn`` when a target is given, a batch smaller than
``n_microbatches``. A batch that ``n_microbatches`` does not divide is split unevenly, as
PyTorch splits it.

See Also:
    :pt:`torch.distributed.pipelining.schedules`: ``ScheduleGPipe``, ``Schedule1F1B``,
    ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``,
    ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, ``get_schedule_class``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from hp_pp import generators
from hp_pp._ties import TiedGradients
from hp_pp.actions import Action, ActionType
from hp_pp.comm_lowering import add_communication
from hp_pp.csv_io import read_csv
from hp_pp.executor import PipelineExecutor, TransposedPreprocess
from hp_pp.microbatch import merge_chunks, split_args_kwargs_into_chunks
from hp_pp.stage import PipelineStage
from hp_pp.transport import defer_receives
from hp_pp.validate import check_schedule

__all__ = [
    "PipelineContext",
    "PipelineScheduleMulti",
    "PipelineScheduleRuntime",
    "PipelineScheduleSingle",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleMPipe",
    "ScheduleZBVZeroBubble",
    "get_schedule_class",
]


class PipelineScheduleRuntime:
    """Runs any action table over this rank's stages: the base of every schedule class.

    Args:
        stages: The stages this rank holds (all of one pipeline, one process group).
        n_microbatches: Micro-batches per step.
        loss_fn: ``loss_fn(output, target)`` on the last stage; ``None``: no backward.
        args_chunk_spec: Chunk spec per positional argument (default: dim 0).
        kwargs_chunk_spec: Chunk spec per keyword argument (default: dim 0).
        output_merge_spec: How to merge the last stage's outputs (default: concat on dim 0).
        scale_grads: Divide gradients by ``n_microbatches`` after the backward.
        actions: Keyword-only. The action table ``{rank: [Action | None, ...]}``, compute-only
            or with transfers; may also be given later with :meth:`load_actions`.
        style: Keyword-only. Stage placement, ``"loop"`` (stage ``s`` on rank
            ``s % pp_size``) or ``"v"`` (stages ``r`` and ``2 * pp_size - 1 - r`` on rank
            ``r``).
        lookahead: Keyword-only. For compute-only tables: ``1`` (default) posts each receive
            as soon as its peer sends it, in a batch with this rank's transfers of that moment
            (what NCCL needs); ``0`` posts each receive just before the compute that needs it
            (less buffer memory), which NCCL's rules allow for few schedules: the table is
            refused when it would deadlock (see :mod:`hp_pp.transport`).

    Raises:
        ValueError: no stages, stages of different pipelines, ``n_microbatches`` < 1, stages
            not where ``style`` places them, or a table that names stages this rank lacks.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`
    """

    def __init__(
        self,
        stages: list[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any, ...] | None = None,
        scale_grads: bool = True,
        *,
        actions: dict[int, list[Action | None]] | None = None,
        style: str = "loop",
        lookahead: int = 1,
    ) -> None:
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
        if not stages:
            raise ValueError("a schedule needs at least one PipelineStage")
        if any(not isinstance(s, PipelineStage) for s in stages):
            raise TypeError(
                "stages must be hp_pp.PipelineStage objects, got "
                f"{[type(s).__name__ for s in stages]}"
            )
        num_stages = {s.num_stages for s in stages}
        if len(num_stages) != 1 or len({id(s.group) for s in stages}) != 1:
            raise ValueError("all stages of a schedule must share num_stages and group")
        if style not in ("loop", "v"):
            raise ValueError(f"style must be 'loop' or 'v', got {style!r}")
        self._stages = sorted(stages, key=lambda s: s.stage_index)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._num_stages = num_stages.pop()
        self._group = self._stages[0].group
        self._pp_size = self._stages[0].group_size
        self._rank = self._stages[0].group_rank
        self._lookahead = lookahead
        self._style = style
        self._bind_stages(style)
        self._executor: PipelineExecutor | None = None
        self._tied: TiedGradients | None = None
        # MPipe's preprocess block (set by ScheduleMPipe before its table is loaded).
        self._preprocess_module: nn.Module | None = None
        self._preprocess_fqn = ""
        self._preprocess_trainable = True
        self._pipeline_order: dict[int, list[Action | None]] = {}
        self._pipeline_order_with_comms: dict[int, list[Action | None]] = {}
        self._loaded: tuple[Any, Any] | None = None
        self._custom_functions: dict[ActionType, Callable[[Action, PipelineContext], None]] = {}
        if actions is not None:
            self.load_actions(actions)

    # -- tables -----------------------------------------------------------------------------

    def _bind_stages(self, style: str) -> None:
        if style == "v" and self._num_stages != 2 * self._pp_size:
            raise ValueError(
                f"a V-shaped schedule needs num_stages == 2 * pp_size = {2 * self._pp_size}, got "
                f"{self._num_stages}"
            )
        if style == "loop" and self._num_stages % self._pp_size != 0:
            raise ValueError(
                f"num_stages={self._num_stages} is not a multiple of pp_size={self._pp_size}"
            )
        expected = generators.rank_to_stages(self._rank, self._pp_size, self._num_stages, style)
        held = [s.stage_index for s in self._stages]
        if held != sorted(expected):
            raise ValueError(
                f"rank {self._rank} holds stages {held}, but the {style!r} mapping of "
                f"{self._num_stages} stages on {self._pp_size} ranks puts stages "
                f"{sorted(expected)} there"
            )
        mapping = {
            s: generators.stage_to_rank(s, self._pp_size, style) for s in range(self._num_stages)
        }
        for stage in self._stages:
            stage.stage_to_group_rank = dict(mapping)
        self._style = style

    def load_actions(
        self, actions: dict[int, list[Action | None]], *, style: str | None = None
    ) -> None:
        """Use ``actions`` (``{rank: [Action | None, ...]}``) as the schedule.

        Args:
            actions: The table; compute-only tables get their transfers implicitly.
            style: Keyword-only. A new stage placement (default: keep the current one).

        Raises:
            ValueError: the table has no row for this rank, names stages it lacks, or (checked
                offline with ``check_schedule`` when it has a row per rank) deadlocks, has
                unmatched transfers or misses work.
        """
        if style is not None and style != self._style:
            self._bind_stages(style)
        if self._rank not in actions:
            raise ValueError(f"the action table has no row for pipeline rank {self._rank}")
        explicit = any(
            a is not None and a.type.is_communication for row in actions.values() for a in row
        )
        whole = len(actions) == self._pp_size
        if not explicit and not whole:
            raise ValueError(
                f"a compute-only table needs every rank's row to place its transfers; got rows "
                f"for ranks {sorted(actions)} of {self._pp_size} (or write the transfers out)"
            )
        checks = {
            "num_stages": self._num_stages,
            "n_microbatches": self._n_microbatches,
            "style": self._style,
        }
        if whole:
            # The whole table: deadlocks (under NCCL's point-to-point rules), unmatched
            # transfers and missing work are found here, before any communication (every rank
            # checks the same table).
            check_schedule(actions, **checks)  # type: ignore[arg-type]
        runs = actions
        if not explicit:
            runs = add_communication(actions, num_stages=self._num_stages, style=self._style)
            if self._lookahead == 0:
                runs = defer_receives(runs)
                try:
                    check_schedule(runs, **checks)  # type: ignore[arg-type]
                except ValueError as err:
                    raise ValueError(
                        "lookahead=0 (defer_pp_recv=True): posting each receive only when it is "
                        f"needed deadlocks this schedule under NCCL's rules: {err}"
                    ) from None
        row = runs[self._rank]
        executor = PipelineExecutor(self._stages, row, preprocess=self._preprocess_for(actions))
        forwards = {
            (a.stage_index, a.microbatch_index)
            for a in executor.compute_actions
            if a.type is ActionType.FORWARD
        }
        want = {(s.stage_index, m) for s in self._stages for m in range(self._n_microbatches)}
        if forwards != want:
            raise ValueError(
                f"the table's forwards on rank {self._rank} are {sorted(forwards)}, expected one "
                f"per stage and micro-batch: {sorted(want)} (n_microbatches="
                f"{self._n_microbatches})"
            )
        executor.custom_functions = self._custom_functions
        self._pipeline_order = {r: list(row) for r, row in actions.items()}
        self._pipeline_order_with_comms = {r: list(row) for r, row in runs.items()}
        self._loaded = (_frozen(self._pipeline_order), _frozen(self._pipeline_order_with_comms))
        self._executor = executor

    @property
    def pipeline_order(self) -> dict[int, list[Action | None]]:
        """The compute table ``{rank: [Action | None, ...]}`` (torch's ``pipeline_order``).

        Setting it (or changing it in place, as a ``PipelineScheduleMulti`` subclass with a
        hand-written schedule does) makes it the schedule from the next step on: its entries
        may be hp-pp :class:`~hp_pp.Action` objects, torch's ``_Action`` objects or their
        compact notation (``"0F1"``); the stage placement is read from the table.
        """
        return self._pipeline_order

    @pipeline_order.setter
    def pipeline_order(self, table: dict[int, list[Any]]) -> None:
        self._pipeline_order = _as_table(table, "pipeline_order")

    @property
    def pipeline_order_with_comms(self) -> dict[int, list[Action | None]]:
        """The table as it runs, transfers included (torch's ``pipeline_order_with_comms``).

        Setting it (or changing it in place) runs that table, transfers as written, from the
        next step on.
        """
        return self._pipeline_order_with_comms

    @pipeline_order_with_comms.setter
    def pipeline_order_with_comms(self, table: dict[int, list[Any]]) -> None:
        self._pipeline_order_with_comms = _as_table(table, "pipeline_order_with_comms")

    def _sync_tables(self) -> None:
        """Load ``pipeline_order`` / ``pipeline_order_with_comms`` when a caller set or
        changed them since the last load (the compute table wins when both changed)."""
        order = _as_table(self._pipeline_order, "pipeline_order")
        with_comms = _as_table(self._pipeline_order_with_comms, "pipeline_order_with_comms")
        loaded = self._loaded or ((), ())
        if order and _frozen(order) != loaded[0]:
            self._prepare_schedule_with_comms(order, format=_format_of(order))
        elif with_comms and _frozen(with_comms) != loaded[1]:
            self._prepare_schedule_with_comms(with_comms, format="compute_comms")

    def _prepare_schedule_with_comms(
        self, actions: dict[int, list[Any]], format: str = "compute_only"
    ) -> None:
        """Make ``actions`` the schedule, torch's way: ``format="compute_only"`` lowers a
        compute table (transfers added), ``"compute_comms"`` runs a table whose transfers are
        written out. The stage placement (loop or V) is read from the table.

        Raises:
            ValueError: a transfer in a ``"compute_only"`` table, a table whose stages sit
                neither in the loop nor in the V placement, or any reason of
                :meth:`load_actions`.
            NotImplementedError: another ``format`` (as torch).

        See Also:
            :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`
        """
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(
                f"format={format!r} is not implemented; expected 'compute_only' or 'compute_comms'"
            )
        table = _as_table(actions, "actions")
        if format == "compute_only":
            for rank, row in table.items():
                for i, a in enumerate(row):
                    if a is not None and a.type.is_communication:
                        raise ValueError(
                            f"format='compute_only' but rank {rank}'s action {i} is the "
                            f"transfer {a} (use format='compute_comms' for a table with "
                            "transfers)"
                        )
        self.load_actions(table, style=self._style_of(table))

    def _load_csv(self, filename: str | Path, format: str = "compute_only") -> None:
        """Read a schedule from a CSV file (one row per rank, torch's compact notation) and
        make it the schedule (:meth:`_prepare_schedule_with_comms` with ``format``).

        See Also:
            :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`
        """
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(
                f"format={format!r} is not implemented; expected 'compute_only' or 'compute_comms'"
            )
        self._prepare_schedule_with_comms(read_csv(filename), format=format)

    def _style_of(self, table: dict[int, list[Action | None]]) -> str:
        """The stage placement a table implies (the current one when it fits)."""
        placed = {
            (a.stage_index, rank)
            for rank, row in table.items()
            for a in row
            if a is not None and not a.type.is_preprocess
        }
        candidates = [self._style] + [s for s in ("loop", "v") if s != self._style]
        for style in candidates:
            if style == "v" and self._num_stages != 2 * self._pp_size:
                continue
            if all(
                generators.stage_to_rank(stage, self._pp_size, style) == rank
                for stage, rank in placed
            ):
                return style
        raise ValueError(
            f"the table puts stages on ranks {sorted(placed)}, which is neither the loop "
            f"placement (stage s on rank s % {self._pp_size}) nor the V placement"
        )

    def register_custom_function(
        self,
        computation_type: Any,
        custom_function: Callable[[Action, PipelineContext], None],
    ) -> None:
        """Run ``custom_function(action, ctx)`` instead of the built-in work of every action
        of ``computation_type``.

        ``computation_type`` is an :class:`~hp_pp.ActionType` or torch's ``_ComputationType``
        (``FORWARD``, ``FULL_BACKWARD``, ``BACKWARD_INPUT``, ``BACKWARD_WEIGHT``,
        ``OVERLAP_F_B``, ``UNSHARD``, ``RESHARD`` or ``REDUCE_GRAD``). ``ctx`` is a
        :class:`~hp_pp.schedules.PipelineContext` (this schedule and the step's
        micro-batches). The executor still waits for the action's receives before the call and
        hands its results on after it: the stage's kept outputs to a next stage on this rank
        (and to ``loss_fn`` on the last stage), the input gradients to a previous stage on
        this rank; so a custom forward calls ``stage.forward_one_chunk`` (or does the same
        work) itself.

        Raises:
            ValueError: another computation type (transfers are the executor's).

        See Also:
            :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`
        """
        kind = _action_type(computation_type)
        if kind not in _CUSTOMIZABLE:
            raise ValueError(
                f"Invalid computation type {computation_type}: only FORWARD, FULL_BACKWARD, "
                "BACKWARD_INPUT, BACKWARD_WEIGHT, OVERLAP_F_B, UNSHARD, RESHARD and REDUCE_GRAD "
                "take a custom function"
            )
        if not callable(custom_function):
            raise TypeError(
                f"custom_function must be callable(action, ctx), got {custom_function!r}"
            )
        self._custom_functions[kind] = custom_function

    def _preprocess_for(
        self, actions: dict[int, list[Action | None]]
    ) -> TransposedPreprocess | None:
        runner_of = {
            a.microbatch_index: rank
            for rank, row in actions.items()
            for a in row
            if a is not None
            and a.type is ActionType.PREPROCESS_F
            and a.microbatch_index is not None
        }
        if not runner_of or self._preprocess_module is None:
            return None
        return TransposedPreprocess(
            self._preprocess_module,
            self._preprocess_fqn,
            generators.stage_to_rank(0, self._pp_size, self._style),
            runner_of,
            trainable=self._preprocess_trainable,
        )

    def load_csv(self, path_or_file: str | Path | IO[str], *, style: str | None = None) -> None:
        """Read the schedule from a CSV file in the compact notation (``read_schedule_csv``)."""
        self.load_actions(read_csv(path_or_file), style=style)

    @property
    def tied_gradients(self) -> TiedGradients | None:
        """The tie groups found at the first step (``None`` before it)."""
        return self._tied

    @property
    def executor(self) -> PipelineExecutor:
        """The executor of this rank's row (its ``events`` list shows the issue/wait order)."""
        self._sync_tables()
        if self._executor is None:
            raise ValueError(
                "no action table loaded: call load_actions() or load_csv(), or set "
                "pipeline_order, first"
            )
        return self._executor

    # -- running ----------------------------------------------------------------------------

    @property
    def _holds_last(self) -> bool:
        return any(s.is_last for s in self._stages)

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one training step on the whole batch (forward, backward, gradient scaling).

        Args:
            *args: The first stage's inputs for the whole batch (other ranks pass none).
            target: The loss target for the whole batch (rank of the last stage).
            losses: A list that receives each micro-batch's loss (rank of the last stage).
            return_outputs: Whether to merge and return the last stage's outputs.
            loss_kwargs: Extra keyword arguments for ``loss_fn``.
            **kwargs: Keyword inputs for the whole batch, given to every stage.

        Returns:
            The merged output on the rank of the last stage (if ``return_outputs``), else
            ``None``.

        Raises:
            ValueError: a batch smaller than ``n_microbatches``, or a missing target.
        """
        return self._run(args, kwargs, target, losses, return_outputs, loss_kwargs, backward=True)

    def eval(
        self, *args: Any, target: Any = None, losses: list[Any] | None = None, **kwargs: Any
    ) -> Any:
        """Forward only (no backward, no gradient change); losses are computed if a target is
        given."""
        return self._run(args, kwargs, target, losses, True, None, backward=False)

    def _run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        losses: list[Any] | None,
        return_outputs: bool,
        loss_kwargs: dict[str, Any] | None,
        *,
        backward: bool,
    ) -> Any:
        executor = self.executor
        n = self._n_microbatches
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list, got {type(losses).__name__}")
        backward = backward and self._loss_fn is not None
        if self._holds_last and backward and target is None:
            raise ValueError(
                "this rank holds the last stage and the schedule has a loss_fn: step() needs "
                "target="
            )
        if self._holds_last and target is not None and self._loss_fn is None:
            raise ValueError(
                "step() got a target but the schedule has no loss_fn (pass loss_fn= to the "
                "schedule)"
            )
        arg_chunks, kwarg_chunks = split_args_kwargs_into_chunks(
            args, kwargs, n, self._args_chunk_spec, self._kwargs_chunk_spec
        )
        target_chunks = None
        if target is not None:
            target_chunks = [c[0] for c in split_args_kwargs_into_chunks((target,), None, n)[0]]
        if any(s.is_first for s in self._stages) and not args and not kwargs:
            raise ValueError("this rank holds the first stage: step() needs the model inputs")
        pre = executor.preprocess
        if pre is not None:
            if self._rank in pre.runner_of.values() and not args and not kwargs:
                raise ValueError(
                    f"MPipe: rank {self._rank} runs the preprocess of micro-batches "
                    f"{sorted(m for m, r in pre.runner_of.items() if r == self._rank)}: pass the "
                    "model inputs to step() on it too"
                )
            pre.broadcast_parameters(self._group)
        if self._tied is None:
            # Set-up, once: which ranks hold each tied parameter (device tensors only). Its
            # all_gather is also the group's first collective, with every rank taking part,
            # before any batch of point-to-point operations (which NCCL asks for when the
            # communicator is created lazily).
            self._tied = TiedGradients(self._stages, self._group)
        last_stage = self._stages[-1]
        if last_stage.is_last:
            # torch's rule: the last stage keeps its outputs only when they are returned.
            last_stage.save_forward_output = return_outputs
        executor.context = PipelineContext(self, arg_chunks, kwarg_chunks, target_chunks, losses)
        mb_losses = executor.run(
            arg_chunks,
            kwarg_chunks,
            target_chunks,
            self._loss_fn if backward or target_chunks is not None else None,
            backward=backward,
            loss_kwargs=loss_kwargs,
        )
        if backward:
            self._tied.reduce()
            if self.scale_grads:
                for stage in self._stages:
                    stage.scale_grads(n)
        if self._holds_last and losses is not None and mb_losses:
            losses.clear()
            losses.extend(mb_losses[m] for m in range(n))
        if self._holds_last and return_outputs:
            last = self._stages[-1]
            chunks = [_detached(last.output_chunks[m]) for m in range(n)]
            last.output_chunks.clear()
            return merge_chunks(chunks, self._output_merge_spec)
        return None


@dataclass
class PipelineContext:
    """What a custom function registered with
    ``PipelineScheduleRuntime.register_custom_function`` sees of the running step.

    Attributes:
        schedule_ref: The schedule running the step.
        arg_mbs: The first stage's positional inputs per micro-batch.
        kwarg_mbs: The keyword inputs per micro-batch.
        target_mbs: The targets per micro-batch (``None`` without a target).
        losses: The list given to ``step(losses=...)``, if any.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._PipelineContext`
    """

    schedule_ref: PipelineScheduleRuntime
    arg_mbs: list[tuple[Any, ...]] | None = None
    kwarg_mbs: list[dict[str, Any]] | None = None
    target_mbs: list[Any] | None = None
    losses: list[Any] | None = None


_CUSTOMIZABLE = frozenset(
    {
        ActionType.FORWARD,
        ActionType.FULL_BACKWARD,
        ActionType.BACKWARD_INPUT,
        ActionType.BACKWARD_WEIGHT,
        ActionType.OVERLAP_F_B,
        ActionType.UNSHARD,
        ActionType.RESHARD,
        ActionType.REDUCE_GRAD,
    }
)


def _action_type(kind: Any) -> ActionType:
    """hp-pp's action type for an ``ActionType``, torch's ``_ComputationType`` or a suffix."""
    if isinstance(kind, ActionType):
        return kind
    name = getattr(kind, "name", None)
    if isinstance(name, str) and name in ActionType.__members__:
        return ActionType[name]
    if isinstance(kind, str):
        try:
            return ActionType(kind)
        except ValueError:
            pass
    raise ValueError(f"unknown computation type {kind!r}")


def _as_action(entry: Any) -> Action | None:
    """An entry of a table: hp-pp's ``Action``, torch's ``_Action`` (read through its compact
    notation), a string in that notation, or ``None``."""
    if entry is None or isinstance(entry, Action):
        return entry
    return Action.parse(str(entry))


def _as_table(table: Any, what: str) -> dict[int, list[Action | None]]:
    if not isinstance(table, dict):
        raise TypeError(f"{what} must be a dict {{rank: [actions]}}, got {type(table).__name__}")
    return {int(r): [_as_action(a) for a in row] for r, row in table.items()}


def _frozen(table: dict[int, list[Any]]) -> tuple[Any, ...]:
    return tuple(
        (r, tuple(None if a is None else str(a) for a in row)) for r, row in sorted(table.items())
    )


def _format_of(table: dict[int, list[Action | None]]) -> str:
    explicit = any(a is not None and a.type.is_communication for row in table.values() for a in row)
    return "compute_comms" if explicit else "compute_only"


def _detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, tuple | list):
        return type(output)(_detached(o) for o in output)
    return output


class PipelineScheduleSingle(PipelineScheduleRuntime):
    """A built-in schedule with one stage per rank (``_schedule_name`` names it).

    See Also:
        :pt:`torch.distributed.pipelining.schedules.PipelineScheduleSingle`
    """

    _schedule_name = ""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any, ...] | None = None,
        scale_grads: bool = True,
    ) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(
                f"{type(self).__name__} takes one hp_pp.PipelineStage, got {type(stage).__name__}"
            )
        style = generators.STYLE.get(self._schedule_name, "loop")
        super().__init__(
            [stage],
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            style=style,
        )
        if self._schedule_name:
            self.load_actions(
                generators.generate(
                    self._schedule_name,
                    pp_size=self._pp_size,
                    num_stages=self._num_stages,
                    n_microbatches=n_microbatches,
                )
            )
        # Without a built-in name the table comes from pipeline_order / _load_csv (torch's way).


class PipelineScheduleMulti(PipelineScheduleRuntime):
    """A built-in schedule with several stages per rank (``_schedule_name`` names it).

    ``backward_requires_autograd`` must be ``True`` (backward runs through autograd);
    ``defer_pp_recv=True`` posts each receive only when its compute needs it (less memory for
    receive buffers, no receive posted ahead).

    A custom schedule, torch's way: subclass it, call ``super().__init__(...)`` and set
    ``self.pipeline_order = {rank: [actions]}`` (hp-pp ``Action`` objects, torch's ``_Action``
    objects or strings such as ``"0F1"``), for every rank; the table is checked (NCCL's
    point-to-point rules, missing work) and lowered with its transfers at the first step.

    See Also:
        :pt:`torch.distributed.pipelining.schedules.PipelineScheduleMulti`
    """

    _schedule_name = ""

    def __init__(
        self,
        stages: list[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any, ...] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
    ) -> None:
        if not backward_requires_autograd:
            raise ValueError(
                "backward_requires_autograd=False is not supported: hp-pp's backward runs "
                "through autograd (give PipelineStage a dw_builder for custom weight gradients)"
            )
        if isinstance(stages, PipelineStage):
            stages = [stages]
        style = (
            generators.STYLE[self._schedule_name]
            if self._schedule_name in generators.SCHEDULE_NAMES
            else "loop"
        )
        super().__init__(
            list(stages),
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            style=style,
            lookahead=0 if defer_pp_recv else 1,
        )
        if self._schedule_name:
            self.load_actions(self._generate(n_microbatches))
        # A subclass without a built-in name writes its own table: it sets (or fills in
        # place) ``pipeline_order``, torch's way, and the first step loads it.

    def _generate(self, n_microbatches: int) -> dict[int, list[Action | None]]:
        return generators.generate(
            self._schedule_name,
            pp_size=self._pp_size,
            num_stages=self._num_stages,
            n_microbatches=n_microbatches,
        )


class _ScheduleForwardOnly(PipelineScheduleSingle):
    """Forward only: every micro-batch through the stages, no loss and no backward.

    ``step`` takes the inputs (first stage) and returns the merged output (last stage), like
    :meth:`PipelineScheduleRuntime.eval` without a target.

    Raises:
        RuntimeError: ``step`` got ``target=`` or ``losses=`` (as torch: no loss here).

    See Also:
        :pt:`torch.distributed.pipelining.schedules._ScheduleForwardOnly`
    """

    _schedule_name = "GPipe"

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Forward of the whole batch (see the class); returns the last stage's output."""
        if target is not None or losses is not None:
            raise RuntimeError("Forward-only schedule does not support loss computation")
        return self._run(args, kwargs, None, None, return_outputs, loss_kwargs, backward=False)


class ScheduleGPipe(PipelineScheduleSingle):
    """All forwards, then all backwards.

    See Also:
        :pt:`torch.distributed.pipelining.ScheduleGPipe`
    """

    _schedule_name = "GPipe"


class Schedule1F1B(PipelineScheduleSingle):
    """One forward, one backward in the steady state.

    See Also:
        :pt:`torch.distributed.pipelining.Schedule1F1B`
    """

    _schedule_name = "1F1B"


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """1F1B over several stages per rank (loop mapping).

    See Also:
        :pt:`torch.distributed.pipelining.ScheduleInterleaved1F1B`
    """

    _schedule_name = "Interleaved1F1B"


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Every micro-batch through one local stage before the next (loop mapping).

    See Also:
        :pt:`torch.distributed.pipelining.ScheduleLoopedBFS`
    """

    _schedule_name = "LoopedBFS"

    def __init__(
        self,
        stages: list[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any, ...] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
    ) -> None:
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            None,
            None,
            output_merge_spec,
            scale_grads,
            backward_requires_autograd,
            defer_pp_recv,
        )


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved schedule with backward split into input (I) and weight (W) parts.

    See Also:
        :pt:`torch.distributed.pipelining.ScheduleInterleavedZeroBubble`
    """

    _schedule_name = "InterleavedZeroBubble"


class ScheduleZBVZeroBubble(PipelineScheduleMulti):
    """Zero-bubble schedule on the V mapping (two stages per rank).

    See Also:
        :pt:`torch.distributed.pipelining.ScheduleZBVZeroBubble`
    """

    _schedule_name = "ZBVZeroBubble"


class ScheduleDualPipeV(PipelineScheduleMulti):
    """DualPipeV on the V mapping, with forward+backward pairs (``OVERLAP_F_B``).

    The two halves of a pair run one after the other: the forward of one micro-batch, then
    the full backward of another, with nothing in between (what torch's runtime does too).
    The pair's transfers are posted in the batches of the lowered table, so the backward's
    receive has normally arrived before the forward computes: the halves do not overlap their
    communication with each other's compute. DeepSeek's DualPipe overlaps one half's compute
    with the other half's expert-parallel all-to-all inside the layers; that needs the model
    to split its layers into compute and communication chunks, which hp-pp does not do. What
    the schedule gains is its order (fewer bubbles, weight passes filling the drain).

    See Also:
        :pt:`torch.distributed.pipelining.ScheduleDualPipeV`
    """

    _schedule_name = "DualPipeV"


class ScheduleMPipe(PipelineScheduleMulti):
    """HyperParallel's MPipe transpose schedule: Interleaved 1F1B whose first micro-batches'
    preprocess block (embeddings, a vision tower) runs on the other ranks during warm-up.

    Stage 0's submodule holds the block at ``preprocess_fqn``; the other ranks pass a module of
    the same structure as ``preprocess`` (its parameters are broadcast from stage 0's rank
    before every step) and pass the model inputs to ``step`` as stage 0's rank does. See
    :class:`~hp_pp.TransposedPreprocess` for what each action does. Loss and gradients equal
    Interleaved 1F1B's.

    Args:
        preprocess_fqn: Keyword-only. The block's name inside stage 0's submodule.
        preprocess: Keyword-only. This rank's copy of the block (not needed on stage 0's rank).
        trainable_preprocess: Keyword-only. ``False`` for a frozen block: no ``PRE_B``.
        Others: as :class:`ScheduleInterleaved1F1B`.

    Raises:
        ValueError: ``preprocess_fqn`` missing from stage 0, or no ``preprocess`` on another
            rank.

    See Also:
        :pt:`torch.distributed.pipelining.ScheduleInterleaved1F1B` (the body schedule).
    """

    _schedule_name = "MPipe"

    def __init__(
        self,
        stages: list[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any, ...] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        preprocess_fqn: str,
        preprocess: nn.Module | None = None,
        trainable_preprocess: bool = True,
    ) -> None:
        stage_list: list[PipelineStage] = (
            [stages] if isinstance(stages, PipelineStage) else list(stages)
        )
        first = [s for s in stage_list if s.is_first]
        if first:
            try:
                preprocess = first[0].submod.get_submodule(preprocess_fqn)
            except AttributeError:
                raise ValueError(
                    f"MPipe: stage 0's submodule has no preprocess block {preprocess_fqn!r}"
                ) from None
        elif preprocess is None:
            raise ValueError(
                "MPipe: ranks without stage 0 run its preprocess block for some micro-batches; "
                "pass preprocess= (a module of the block's structure)"
            )
        self._mpipe = (preprocess, preprocess_fqn, trainable_preprocess)
        super().__init__(
            stage_list,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            backward_requires_autograd,
            defer_pp_recv,
        )

    def _preprocess_for(
        self, actions: dict[int, list[Action | None]]
    ) -> TransposedPreprocess | None:
        self._preprocess_module, self._preprocess_fqn, self._preprocess_trainable = self._mpipe
        return super()._preprocess_for(actions)

    def _generate(self, n_microbatches: int) -> dict[int, list[Action | None]]:
        from hp_pp.generators.mpipe import mpipe

        return mpipe(
            pp_size=self._pp_size,
            num_stages=self._num_stages,
            n_microbatches=n_microbatches,
            trainable_preprocess=self._mpipe[2],
        )


_CLASSES: dict[str, type[PipelineScheduleRuntime]] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
    "MPipe": ScheduleMPipe,
    # torch's map also names the two bases (a table then comes from _load_csv/pipeline_order).
    "PipelineScheduleSingle": PipelineScheduleSingle,
    "PipelineScheduleMulti": PipelineScheduleMulti,
}


def get_schedule_class(schedule_name: str) -> type[PipelineScheduleRuntime]:
    """The schedule class of a name (case-insensitive; ``"ScheduleZBVZeroBubble"``, ``"ZBV"``,
    ``"zbvzerobubble"`` and ``"MPipe"`` all work; ``"PipelineScheduleSingle"`` and
    ``"PipelineScheduleMulti"`` give the bases, whose table a caller then loads, as in torch).

    Raises:
        ValueError: unknown name (the message lists the valid ones).

    See Also:
        :pt:`torch.distributed.pipelining.schedules.get_schedule_class`
    """
    key = schedule_name.strip().lower().removeprefix("schedule")
    for name, cls in _CLASSES.items():
        if key == name.lower():
            return cls
    try:
        return _CLASSES[generators.canonical_schedule_name(schedule_name)]
    except (ValueError, KeyError):
        raise ValueError(
            f"unknown schedule {schedule_name!r}; expected one of {list(_CLASSES)}"
        ) from None
