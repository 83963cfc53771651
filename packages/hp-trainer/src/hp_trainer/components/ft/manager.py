"""The torchft integration: one replica group of a fault-tolerant job.

torchft is the engine: its lighthouse forms quorums of replica groups, its ``Manager``
reconfigures the cross-group process group, votes on each commit and moves the state of a live
peer to a group that recovers (HTTP checkpoint transport). This module connects it to the
trainer: what is all-reduced across groups, what state a recovering group receives, which
samples each group reads, and the checks that refuse a bad setup.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.tensor import DTensor

from hp_trainer.components.checkpoint import LRSchedulersState
from hp_trainer.components.ft.data import replica_batches, replica_sample_indices

if TYPE_CHECKING:
    from hp_trainer.config import FaultToleranceConfig, JobConfig

__all__ = ["FTManager", "check_fault_tolerance_layout", "config_fingerprint"]

# sections and fields that may differ between replica groups (everything else must match)
_PER_GROUP = {"job", "metrics", "checkpoint", "profiling", "validation", "comm"}
_PER_GROUP_FT = {"replica_id", "lighthouse", "trace"}


def _import_torchft() -> Any:
    try:
        import torchft  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - torchft is a dev dependency
        raise ImportError(
            "fault_tolerance.enable = true needs torchft (pip install 'hp-trainer[ft]')"
        ) from exc
    return torchft


def check_fault_tolerance_layout(job_config: JobConfig) -> None:
    """Refuse the layouts fault tolerance cannot run (before any quorum).

    Args:
        job_config: The configuration.

    Raises:
        ValueError: ``data_parallel_replicate_degree > 1`` inside a replica group (the groups
            are the replicas), a streamed dataset (its position cannot move with the quorum),
            or semi-synchronous training with pipeline parallelism.
    """
    par = job_config.parallelism
    ft = job_config.fault_tolerance
    if par.data_parallel_replicate_degree > 1:
        raise ValueError(
            "parallelism.data_parallel_replicate_degree = "
            f"{par.data_parallel_replicate_degree} with fault_tolerance.enable = true: expected 1 "
            "(the replica groups are the replicate dimension; shard inside a group with "
            "data_parallel_shard_degree and start one hp-train per replica group)"
        )
    if job_config.data.streaming:
        raise ValueError(
            "data.streaming = true with fault_tolerance.enable = true: expected a map-style "
            "dataset (the replica groups share one indexed sample stream)"
        )
    if ft.semi_sync_method != "none" and par.pipeline_parallel_degree > 1:
        raise ValueError(
            f"fault_tolerance.semi_sync_method = {ft.semi_sync_method!r} with "
            f"parallelism.pipeline_parallel_degree = {par.pipeline_parallel_degree}: expected "
            "'none' (LocalSGD/DiLoCo wrap one model part)"
        )


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = value


def config_fingerprint(job_config: JobConfig) -> tuple[list[str], list[int]]:
    """The fields every replica group must share, and a 31-bit hash of each value.

    Per-group fields (``job``, ``metrics``, ``checkpoint``, ``profiling``, ``validation``,
    ``fault_tolerance.replica_id`` / ``lighthouse`` / ``trace``) are left out.

    Args:
        job_config: The configuration.

    Returns:
        ``(field names, hashes)`` in a fixed order.
    """
    flat: dict[str, Any] = {}
    _flatten("", job_config.to_dict(), flat)
    names = []
    hashes = []
    for name in sorted(flat):
        section, _, field_name = name.partition(".")
        if section in _PER_GROUP:
            continue
        if section == "fault_tolerance" and field_name in _PER_GROUP_FT:
            continue
        names.append(name)
        text = json.dumps(flat[name], sort_keys=True, default=str)
        hashes.append(zlib.crc32(text.encode()) & 0x7FFFFFFF)
    return names, hashes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _optimizer_to_local(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "state": {
            idx: {k: _local(v).detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for idx, s in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def _optimizer_from_local(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    restored: dict[Any, Any] = {}
    for idx, entries in state["state"].items():
        param = params[int(idx)]
        out = {}
        for key, value in entries.items():
            if isinstance(param, DTensor) and torch.is_tensor(value) and value.dim() > 0:
                value = DTensor.from_local(
                    value,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
            out[key] = value
        restored[idx] = out
    optimizer.load_state_dict({"state": restored, "param_groups": state["param_groups"]})


class FTManager:
    """One replica group's side of a torchft fault-tolerant job.

    Built by the trainer when ``fault_tolerance.enable``: a torchft ``Manager`` (group rank 0
    runs its manager server, which talks to the lighthouse) over a reconfigurable torchft
    process group that spans the replica groups (rank ``r`` of every group). Synchronous mode
    (``semi_sync_method = "none"``): every step starts a quorum (a group that restarted
    receives the model, optimizer, LR schedule, data position and step from a live peer before
    its forward), the gradients' local shards are averaged across the participating groups in
    one all-reduce through the managed group (the replicate all-reduce of HSDP, with FSDP
    inside each group), and the optimizer steps only when the quorum votes to commit
    (``should_commit``: every participant succeeded and at least ``min_replica_size`` took
    part). LocalSGD / DiLoCo: torchft's wrappers around the inner optimizer synchronise every
    ``sync_steps`` steps.

    Args:
        trainer: The :class:`~hp_trainer.LLMTrainer` (model, optimizers, schedulers, loader).

    Raises:
        ValueError: A layout fault tolerance cannot run
            (``check_fault_tolerance_layout``), or no lighthouse address.
        ConnectionError: The lighthouse does not answer within
            ``process_group_timeout_ms`` (the message names the address).

    See Also:
        :titan:`torchtitan.components.ft.manager.FTManager`: TorchTitan's wrapper of torchft's
        Manager; :pt:`torch.distributed.ProcessGroup` (what the managed group stands in for).
    """

    def __init__(self, trainer: Any) -> None:
        _import_torchft()
        # torchft logs every commit at INFO; keep its warnings and errors
        for name in ("torchft", "torchft_commits", "torchft_quorums"):
            logging.getLogger(name).setLevel(logging.WARNING)
        from torchft.coordination import LighthouseClient  # type: ignore[import-untyped]
        from torchft.manager import Manager  # type: ignore[import-untyped]
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL  # type: ignore[import-untyped]

        job_config: JobConfig = trainer.job_config
        check_fault_tolerance_layout(job_config)
        self.config: FaultToleranceConfig = job_config.fault_tolerance
        cfg = self.config
        self.trainer = trainer
        self.semi_sync = cfg.semi_sync_method != "none"
        self.group_rank = dist.get_rank() if dist.is_initialized() else 0
        self.group_world_size = dist.get_world_size() if dist.is_initialized() else 1
        timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
        self.lighthouse = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not self.lighthouse:
            raise ValueError(
                "fault_tolerance.lighthouse is empty and $TORCHFT_LIGHTHOUSE is not set: expected "
                "the lighthouse address, e.g. http://127.0.0.1:29510 (start one with "
                "hp-train --lighthouse)"
            )
        if self.group_rank == 0:  # the rank whose manager server talks to the lighthouse
            try:
                LighthouseClient(self.lighthouse, connect_timeout=timeout)
            except RuntimeError as exc:
                raise ConnectionError(
                    f"the torchft lighthouse at {self.lighthouse} did not answer within "
                    f"{cfg.process_group_timeout_ms} ms (fault_tolerance.lighthouse / "
                    f"$TORCHFT_LIGHTHOUSE; start it with hp-train --lighthouse): {exc}"
                ) from exc
        self._own_store: TCPStore | None = None
        if dist.is_initialized() and "MASTER_ADDR" in os.environ:
            store_addr = os.environ["MASTER_ADDR"]
            store_port = int(os.environ["MASTER_PORT"])
        else:  # a one-rank group has no launcher store: the manager gets its own
            self._own_store = TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout
            )
            store_addr, store_port = "127.0.0.1", self._own_store.port
        pg_cls = ProcessGroupGloo if cfg.process_group == "gloo" else ProcessGroupNCCL
        self.process_group = pg_cls(timeout=timeout)
        self.manager = Manager(
            pg=self.process_group,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=cfg.min_replica_size,
            use_async_quorum=False,  # a recovering group loads its state before the forward
            timeout=timeout,
            quorum_timeout=timedelta(milliseconds=cfg.quorum_timeout_ms),
            connect_timeout=timeout,
            rank=self.group_rank,
            world_size=self.group_world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=self.lighthouse,
            replica_id=f"hp_ft_{cfg.replica_id}",
            init_sync=False,  # every group initialises the same weights from the same seed
        )
        self.fields, self.fingerprint = config_fingerprint(job_config)
        self.manager.register_state_dict_fn("hp", self._load_state, self._state)
        # on-disk checkpoints carry the manager's step and committed batches too
        trainer.checkpointer.states["fault_tolerance"] = self
        self.committed = False
        self.healed_from_peer = 0
        """Times this group received the state of a live peer."""
        self.replica_rank = cfg.replica_id
        self.num_replicas = cfg.group_size
        self._checked_quorum: int | None = None
        self._positions: list[list[int]] = []
        self._cursor = 0
        self._quorum_s = 0.0
        self._step_start_healed = 0
        self._trace: Path | None = None
        if cfg.trace:
            folder = trainer.run_folder
            folder.mkdir(parents=True, exist_ok=True)
            self._trace = folder / f"ft_trace_rank{self.group_rank}.jsonl"
        self._wrapper: Any = None
        if self.semi_sync:
            self._wrapper = self._build_semi_sync(trainer, job_config)

    # -- recovery state ------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """What a recovering group receives: local shards only (the layouts match)."""
        t = self.trainer
        model = [
            {
                name: _local(v).detach().clone()
                for name, v in (*part.named_parameters(), *part.named_buffers())
            }
            for part in t.model_parts
        ]
        return {
            "fingerprint": (self.fields, self.fingerprint),
            "model": model,
            "optimizers": [_optimizer_to_local(o.state_dict()) for o in t.optimizers],
            "lr_schedulers": LRSchedulersState(t.lr_schedulers).state_dict(),
            "dataloader": t.dataloader.state_dict(),
            "step": t.step,
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        fields, hashes = state["fingerprint"]
        self._refuse_mismatch(fields, hashes, "the peer it recovers from")
        t = self.trainer
        with torch.no_grad():
            for part, values in zip(t.model_parts, state["model"], strict=True):
                for name, v in (*part.named_parameters(), *part.named_buffers()):
                    _local(v).copy_(values[name])
        for opt, opt_state in zip(t.optimizers, state["optimizers"], strict=True):
            _optimizer_from_local(opt, opt_state)
        LRSchedulersState(t.lr_schedulers).load_state_dict(state["lr_schedulers"])
        t.dataloader.load_state_dict(state["dataloader"])
        t.step = int(state["step"])
        self.healed_from_peer += 1

    def _refuse_mismatch(self, fields: list[str], hashes: list[int], whom: str) -> None:
        if fields == self.fields and hashes == self.fingerprint:
            return
        mine = dict(zip(self.fields, self.fingerprint, strict=True))
        theirs = dict(zip(fields, hashes, strict=True))
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise ValueError(
            f"replica group {self.config.replica_id} was refused at the quorum: its config "
            f"differs from {whom} in {', '.join(differ)} (every replica group must run the "
            "same configuration apart from job/metrics/checkpoint/profiling and "
            "fault_tolerance.replica_id)"
        )

    def state_dict(self) -> dict[str, Any]:
        """The torchft manager's step and committed batches (for on-disk checkpoints)."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a full restart from disk)."""
        self.manager.load_state_dict({k: int(v) for k, v in state.items()})

    # -- the step ------------------------------------------------------------------------------

    def begin_step(self, batches: Any) -> Any:
        """Start the step's quorum (synchronous mode) and return this rank's micro-batches.

        A group that restarted heals here (the trainer's step jumps to the peers'); the
        config of every participant is compared once per new quorum.

        Args:
            batches: The trainer's micro-batches (replaced under the fault-tolerant data rule).

        Returns:
            This rank's micro-batches for the step.
        """
        t = self.trainer
        manager = self.manager
        healed = self.healed_from_peer
        started = time.perf_counter()
        if not self.semi_sync:
            manager.start_quorum()
            rank = manager.participating_rank()
            self.replica_rank = 0 if rank is None else rank
            self.num_replicas = max(manager.num_participants(), 1)
            self._check_quorum_config()
        self._step_start_healed = self.healed_from_peer - healed
        self._quorum_s = time.perf_counter() - started
        micro = t.gradient_accumulation_steps
        loader = t.dataloader
        self._cursor = loader.samples_consumed
        self._positions = replica_sample_indices(
            self._cursor,
            self.replica_rank,
            self.num_replicas,
            t.dp_rank,
            t.parallel_dims.dp_degree,
            loader.batch_size,
            micro,
        )
        new_batches, _ = replica_batches(loader, self._positions)
        return new_batches

    def _check_quorum_config(self) -> None:
        """Refuse a participant whose config differs (once per new quorum)."""
        quorum_id = getattr(self.manager, "_quorum_id", None)
        if quorum_id == self._checked_quorum:
            return
        self._checked_quorum = quorum_id
        n = self.num_replicas
        width = len(self.fingerprint) + 1
        table = torch.zeros(n, width, dtype=torch.int64)
        table[self.replica_rank, 0] = self.manager.current_step()
        table[self.replica_rank, 1:] = torch.tensor(self.fingerprint, dtype=torch.int64)
        from torch.distributed import ReduceOp

        self.manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return  # the step is discarded; the next quorum checks again
        rows = [tuple(r) for r in table.tolist()]
        # the reference: the most common config, ties to the lowest quorum rank
        counts = [sum(other[1:] == row[1:] for other in rows) for row in rows]
        ref = max(range(n), key=lambda i: (counts[i], -i))
        self._refuse_mismatch(
            self.fields, list(rows[ref][1:]), f"replica group at quorum rank {ref}"
        )

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Average the gradients' local shards across the participating groups (one all-reduce).

        Args:
            params: The trainer's parameters, in the same order in every group.
        """
        if self.semi_sync:
            return
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def should_commit(self) -> bool:
        """The quorum's vote on this step (always True between LocalSGD/DiLoCo syncs)."""
        if self.semi_sync:
            self.committed = True
            return True
        self.committed = self.manager.should_commit()
        return self.committed

    def end_step(self) -> bool:
        """Advance the data position if the step committed; write the trace record.

        Returns:
            Whether the step committed (False: the trainer runs it again).
        """
        t = self.trainer
        loader = t.dataloader
        if self.committed:  # the step's whole slab, over all participants, is consumed
            slab = len(self._positions) * loader.batch_size * t.parallel_dims.dp_degree
            loader.samples_consumed = self._cursor + slab * self.num_replicas
        if self._trace is not None:
            record = {
                "step": t.step,
                "committed": self.committed,
                "participants": self.num_replicas,
                "replica_rank": self.replica_rank,
                "positions": [q for p in self._positions for q in p],
                "healed": self._step_start_healed,
                "params": self.param_digest(),
                "manager_step": self.manager.current_step(),
                "quorum_s": round(self._quorum_s, 4),
                "time": time.time(),
            }
            with self._trace.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return self.committed

    def param_digest(self) -> str:
        """SHA-256 of this rank's local parameter shards (bitwise comparison across groups)."""
        h = hashlib.sha256()
        for part in self.trainer.model_parts:
            for _, p in part.named_parameters():
                h.update(_local(p).detach().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # -- LocalSGD / DiLoCo ---------------------------------------------------------------------

    def _build_semi_sync(self, trainer: Any, job_config: JobConfig) -> Any:
        from torchft.local_sgd import DiLoCo, LocalSGD  # type: ignore[import-untyped]

        cfg = self.config
        inner = trainer.optimizers.optimizers[0]
        model = trainer.model_parts[0]
        if cfg.semi_sync_method == "local_sgd":
            return LocalSGD(self.manager, model, inner, cfg.sync_steps).__enter__()
        if cfg.module_fqns_per_model_fragment:
            fragments = _named_fragments(model, cfg.module_fqns_per_model_fragment)
        else:
            fragments = _split_fragments(model, cfg.num_fragments)
        outer = [
            torch.optim.SGD(
                f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True
            )
            for f in fragments
        ]
        return DiLoCo(
            self.manager,
            fragments,
            inner,
            outer,
            cfg.sync_steps,
            pin_memory=False,
            fragment_sync_delay=cfg.fragment_sync_delay,
            fragment_update_alpha=cfg.fragment_update_alpha,
            should_quantize=cfg.should_quantize,
        ).__enter__()

    def shutdown(self) -> None:
        """Leave the quorum: stop the manager server and the checkpoint transport."""
        if self._wrapper is not None:
            self._wrapper.__exit__(None, None, None)
            self._wrapper = None
        self.manager.shutdown(wait=False)


def _split_fragments(model: torch.nn.Module, num_fragments: int) -> list[torch.nn.Module]:
    """DiLoCo fragments: consecutive transformer blocks (embeddings first, head last)."""
    if num_fragments == 1:
        return [model]
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) < num_fragments:
        count = 0 if layers is None else len(layers)
        raise ValueError(
            f"fault_tolerance.num_fragments = {num_fragments}: expected at most the model's "
            f"{count} transformer blocks"
        )
    blocks = list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)
    others = [m for name, m in model.named_children() if name != "layers"]
    per = len(blocks) / num_fragments
    fragments: list[torch.nn.Module] = []
    for i in range(num_fragments):
        members = blocks[round(i * per) : round((i + 1) * per)]
        if i == 0:
            members = [m for m in others[:1]] + members
        if i == num_fragments - 1:
            members = members + others[1:]
        fragments.append(torch.nn.ModuleList(members))
    return fragments


def _named_fragments(model: torch.nn.Module, fqns: list[list[str]]) -> list[torch.nn.Module]:
    """DiLoCo fragments from module names: each parameter in exactly one fragment."""
    modules = dict(model.named_modules())
    owner: dict[str, int] = {}
    fragments: list[torch.nn.Module] = []
    for index, names in enumerate(fqns):
        unknown = [n for n in names if n not in modules or not n]
        if unknown:
            raise ValueError(
                f"fault_tolerance.module_fqns_per_model_fragment[{index}]: no module named "
                f"{unknown} in the model"
            )
        for name in names:
            for pname, _ in modules[name].named_parameters(prefix=name):
                if pname in owner and owner[pname] != index:
                    raise ValueError(
                        f"fault_tolerance.module_fqns_per_model_fragment: parameter {pname!r} is "
                        f"in fragments {owner[pname]} and {index}; expected exactly one"
                    )
                owner[pname] = index
        fragments.append(torch.nn.ModuleList([modules[n] for n in names]))
    missing = [name for name, _ in model.named_parameters() if name not in owner]
    if missing:
        raise ValueError(
            "fault_tolerance.module_fqns_per_model_fragment leaves parameters in no fragment "
            f"(never synchronised): {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    return fragments


StateFn = Callable[[], dict[str, Any]]
