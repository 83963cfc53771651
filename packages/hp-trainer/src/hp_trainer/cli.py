"""The ``hp-train`` command: parse the config, start local ranks if needed, train."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from hp_trainer.config import ConfigManager, JobConfig
from hp_trainer.preflight import preflight

__all__ = [
    "EXIT_STOPPED_SAVED",
    "EXIT_STOPPED_UNSAVED",
    "LaunchOptions",
    "main",
    "needs_launcher",
    "nproc_for",
    "split_launch_options",
]

# Variables torch's launchers (torchrun / elastic agent) and Slurm-style setups export.
_LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE")

EXIT_STOPPED_SAVED = 75
"""Exit status of ``hp-train`` when SIGTERM stopped the run after a checkpoint of its last
completed step was saved: run the same command again to resume (``EX_TEMPFAIL``; 0 is a
finished run, 1 a failed rank, 2 a bad configuration)."""

EXIT_STOPPED_UNSAVED = 143
"""Exit status of ``hp-train`` when SIGTERM stopped the run with checkpointing off
(128 + SIGTERM): the steps done are lost."""

_STOP_STATUS = {"saved": EXIT_STOPPED_SAVED, "unsaved": EXIT_STOPPED_UNSAVED}


def _stop_status(run_folder: Path, since: float) -> int | None:
    """The exit status a ``stopped.json`` written after ``since`` (a time stamp) asks for."""
    record = run_folder / "stopped.json"
    try:
        if record.stat().st_mtime < since:
            return None
        status = json.loads(record.read_text()).get("status")
    except (OSError, ValueError):
        return None
    return _STOP_STATUS.get(status)


@dataclass(frozen=True)
class LaunchOptions:
    """torchrun's rendezvous options that ``hp-train`` accepts for a multi-node job.

    Attributes:
        nnodes: Number of nodes (launcher processes) that form the job.
        node_rank: This node's index (optional with the c10d rendezvous).
        rdzv_endpoint: ``host:port`` of the rendezvous (needed when ``nnodes > 1``).
        rdzv_id: Job id shared by the nodes.
    """

    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "hp-train"

    @property
    def multi_node(self) -> bool:
        """Whether rendezvous options were given (else a standalone single-node job)."""
        return self.nnodes > 1 or self.rdzv_endpoint is not None


_LAUNCH_FLAGS = {
    "nnodes": "nnodes",
    "node_rank": "node_rank",
    "rdzv_endpoint": "rdzv_endpoint",
    "rdzv_id": "rdzv_id",
}


def split_launch_options(args: list[str]) -> tuple[LaunchOptions, list[str]]:
    """Take torchrun's rendezvous options out of ``args``.

    Args:
        args: ``hp-train`` arguments.

    Returns:
        The launch options and the remaining (config) arguments.

    Raises:
        ValueError: For a missing or invalid value, or ``--nnodes > 1`` without
            ``--rdzv-endpoint``.

    See Also:
        :pt:`torch.distributed.run`: ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``.
    """
    found: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        key, eq, inline = args[i].removeprefix("--").partition("=")
        name = _LAUNCH_FLAGS.get(key.replace("-", "_")) if args[i].startswith("--") else None
        if name is None:
            rest.append(args[i])
            i += 1
            continue
        if eq:
            found[name] = inline
            i += 1
        elif i + 1 < len(args):
            found[name] = args[i + 1]
            i += 2
        else:
            raise ValueError(f"option {args[i]} needs a value")
    try:
        nnodes = int(found.get("nnodes", "1"))
        node_rank = int(found["node_rank"]) if "node_rank" in found else None
    except ValueError:
        raise ValueError(
            f"--nnodes / --node-rank need integers, got {found.get('nnodes')!r} / "
            f"{found.get('node_rank')!r}"
        ) from None
    endpoint = found.get("rdzv_endpoint")
    if nnodes < 1 or (node_rank is not None and not 0 <= node_rank < nnodes):
        raise ValueError(
            f"--nnodes {nnodes} / --node-rank {node_rank}: expected 0 <= rank < nnodes"
        )
    if nnodes > 1 and endpoint is None:
        raise ValueError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)"
        )
    if endpoint is not None and not endpoint.rpartition(":")[2].isdigit():
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT")
    options = LaunchOptions(nnodes, node_rank, endpoint, found.get("rdzv_id", "hp-train"))
    return options, rest


def nproc_for(config: JobConfig) -> int:
    """Local ranks to start for ``config`` when not under a launcher.

    ``job.nproc_per_node`` when set, else the product of the parallel degrees (1 when
    ``data_parallel_shard_degree`` is -1 and nothing else is set).

    Args:
        config: The configuration.

    Returns:
        The number of processes.

    See Also:
        :pt:`torch.distributed.run`: ``--nproc-per-node``.
    """
    if config.job.nproc_per_node > 0:
        return config.job.nproc_per_node
    p = config.parallelism
    others = (
        p.data_parallel_replicate_degree
        * p.tensor_parallel_degree
        * p.context_parallel_degree
        * p.pipeline_parallel_degree
    )
    shard = p.data_parallel_shard_degree
    return others * (shard if shard > 0 else 1)


def needs_launcher(config: JobConfig) -> bool:
    """Whether ``hp-train`` must start worker processes itself.

    Args:
        config: The configuration.

    Returns:
        True when no launcher environment is present and more than one rank is wanted.

    See Also:
        :pt:`torch.distributed.run`: the launcher ``hp-train`` uses.
    """
    under_launcher = any(name in os.environ for name in _LAUNCHER_ENV)
    return not under_launcher and nproc_for(config) > 1


# Imported by the forkserver the ranks fork from, once for all local ranks: the training stack,
# torch._dynamo, which a rank imports lazily while it builds its model (0.5 CPU s each), and
# hp_pp, whose schedule names every rank's config checks (0.6 CPU s each).
_PRELOAD = ("hp_trainer.cli", "hp_trainer.trainer", "torch._dynamo", "hp_pp")


def _rank_main(argv: list[str]) -> None:
    """What each local rank runs: ``main`` with the job's arguments, in a process forked from
    the launcher's forkserver (see ``_launch``)."""
    sys.argv = ["hp-train", *argv]  # a forkserver child's argv is the server's ("-c")
    # torchrun started each rank as ``python -u``: keep the ranks' output line by line
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(line_buffering=True)
    try:
        status = main(argv)
    except BaseException:
        if _local_rank_gone():
            # Failed after a local peer ended (a collective with a dead rank): stay until the
            # agent has seen that rank's end and stops this one, so the failure it reports is
            # the peer's (the agent names the first failed rank it finds, not every one).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(_PEER_FAILURE_WAIT_S)
        raise
    finally:
        # a multiprocessing child ends with os._exit: run the exit handlers an interpreter runs
        # (logging's flush, torch's own), as a ``python -m hp_trainer.cli`` rank did
        run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
        if run_exit_handlers is not None:
            run_exit_handlers()
    if status:
        sys.exit(status)  # the rank's exit status, as a ``python -m hp_trainer.cli`` rank had
    if _signal_stops and _signal_stops[-1] is not None:
        # Stopped by SIGTERM. torch's wrapper now hands the return value to the agent and waits
        # for the agent to release it; an agent that is itself stopping (SIGTERM to the
        # launcher: it signalled this rank) never does, and would SIGKILL it after 30 s.
        _leave_once_returned()


_PEER_FAILURE_WAIT_S = 60.0
_RELEASE_WAIT_S = 2.0


def _leave() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave_after(seconds: float) -> None:
    time.sleep(seconds)
    _leave()


def _leave_once_returned() -> None:
    """End this rank (status 0) as soon as torch's wrapper has written its return value.

    The wrapper writes the value to the agent's pipe with ``SimpleQueue.put`` (one synchronous
    write), then waits for the agent's release. Once ``put`` has returned, leaving loses
    nothing: a monitoring agent reads the value from the pipe after the writer ended and sees
    exit status 0; a stopping agent only waits for the process to end. A profile hook on this
    (the main) thread sees ``put`` return; leaving before it would leave a monitoring agent
    waiting for a value forever, so nothing else triggers the exit but a fallback timer of
    ``_RELEASE_WAIT_S`` seconds (a wrapper that returns the value some other way).
    """
    from multiprocessing.queues import SimpleQueue

    put = SimpleQueue.put.__code__

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is put:
            sys.setprofile(None)
            _leave()

    sys.setprofile(hook)
    threading.Thread(target=_leave_after, args=(_RELEASE_WAIT_S,), daemon=True).start()


def _child_states(parent: int) -> list[str] | None:
    """The states (``R``, ``S``, ``Z``, ...) of ``parent``'s child processes, from Linux's
    ``/proc``; None where it cannot be read."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    states = []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            fields = Path("/proc", name, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            states.append(fields[0])
    return states


def _local_rank_gone() -> bool:
    """Whether a local rank of this job has already ended (Linux ``/proc``; else False).

    The ranks are the forkserver's only children; one that finishes waits in torch's wrapper
    until every rank has returned, so a rank gone this early has failed.
    """
    expected = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    states = _child_states(os.getppid())
    if states is None:
        return False
    return sum(state not in ("Z", "X") for state in states) < expected


def _reap_forkserver(timeout: float = 30.0) -> None:
    """Stop this process's multiprocessing forkserver and wait for it, bounded.

    The ranks are the server's children and it reaps them; waiting for the server makes their
    CPU time this launcher's children's (what ``getrusage`` and ``time`` report), and leaves no
    process behind the launcher. A server with no child left (the agent joined every rank,
    so the server has reaped them) is killed rather than left to tear its interpreter down
    (0.6 s here, on the way out of every ``hp-train``); one whose children cannot be listed
    (no ``/proc``) or that still has one is asked to exit and waited for. A server still held
    by a rank the agent gave up on (stuck in the kernel) is left after ``timeout`` rather than
    hanging the launcher.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if pid is None or alive is None:
        return
    os.close(alive)  # EOF on its "alive" pipe once no rank holds it either: the server exits
    server._forkserver_alive_fd = None  # type: ignore[union-attr]
    server._forkserver_pid = None  # type: ignore[union-attr]
    server._forkserver_address = None  # type: ignore[union-attr]
    if _child_states(pid) == []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.02)


def _launch(
    nproc: int, argv: list[str], run_folder: Path, launch: LaunchOptions, *, preload: list[str]
) -> int:
    import multiprocessing
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    # torchrun --standalone: a c10d rendezvous on a free local port
    rendezvous = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}"]
    if launch.multi_node:
        rendezvous = [
            f"--nnodes={launch.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={launch.rdzv_endpoint}",
            f"--rdzv-id={launch.rdzv_id}",
        ]
        # the c10d rendezvous numbers the nodes itself (torchrun ignores --node-rank with it)
    # forkserver where the platform has it (Linux, macOS); elsewhere (Windows) each rank is a
    # spawned interpreter that imports the stack itself, as under torchrun
    start_method = "forkserver"
    if start_method not in multiprocessing.get_all_start_methods():
        start_method = "spawn"
    launcher_args = get_args_parser().parse_args(
        [
            *rendezvous,
            f"--nproc-per-node={nproc}",
            "--local-ranks-filter=0",
            f"--start-method={start_method}",
            "hp-train",  # the entry point is _rank_main, not a script
        ]
    )
    # one intra-op thread per rank unless the user chose otherwise (torchrun's own default)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config, _, _ = config_from_args(launcher_args)
    # The ranks fork from a forkserver that imported the training stack once, instead of each
    # starting an interpreter that imports it (torchrun --module). The server is a fresh
    # interpreter (no thread, nothing initialised on a device: the import does not touch
    # one), so each rank initialises its own device after the fork, as under torchrun.
    if start_method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    started = time.time()
    try:
        # the job's own arguments go to the ranks as they are (torchrun's parser would read
        # "--nproc" as an ambiguous abbreviation of its "--nproc-per-node"/"--nproc_per_node")
        from hp_trainer.cli import _rank_main  # by this name, also when run as __main__

        elastic_launch(config, entrypoint=_rank_main)(list(argv))
    except Exception as exc:  # torch's ChildFailedError already printed its failure report
        # SIGTERM to this launcher too (a scheduler stopping the job): the agent passed it on,
        # waited for the ranks, then raised; the ranks' own record says whether they saved
        stopped = _stop_status(run_folder, started)
        if stopped is not None and type(exc).__name__ == "SignalException":
            return stopped
        print(f"hp-train: {_describe_failure(exc)}", file=sys.stderr, flush=True)
        return 1
    finally:
        _reap_forkserver()
    return _stop_status(run_folder, started) or 0


def _nproc_per_node(config: JobConfig, nnodes: int) -> int:
    """Local ranks per node: ``job.nproc_per_node``, else the job's ranks split over nodes."""
    if config.job.nproc_per_node > 0:
        return config.job.nproc_per_node
    total = nproc_for(config)
    if total % nnodes != 0:
        raise ValueError(
            f"the parallel degrees need {total} ranks, which {nnodes} nodes cannot share "
            "equally: set --nproc (ranks per node)"
        )
    return total // nnodes


def _describe_failure(exc: Exception) -> str:
    """One line naming the failed rank(s) of a ``ChildFailedError`` (else the exception)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"a worker failed ({type(exc).__name__}: {exc})"
    parts = []
    for rank in sorted(failures):
        failure = failures[rank]
        code = getattr(failure, "exitcode", "?")
        how = f"exit code {code}"
        if isinstance(code, int) and code < 0:
            how = f"killed by signal {failure.signal_name()}"
        parts.append(f"rank {rank} (pid {getattr(failure, 'pid', '?')}) failed: {how}")
    return "; ".join(parts) + "; the other ranks were stopped"


_LAUNCH_HELP = """
[launch] multi-node jobs (torchrun's rendezvous options; not needed under torchrun or Slurm)
  --nnodes N                number of nodes; run hp-train once per node with the same options
  --node-rank R             this node's index (optional)
  --rdzv-endpoint HOST:PORT rendezvous address, the same on every node (needed with --nnodes > 1)
  --rdzv-id ID              job id shared by the nodes (default: hp-train)

[fault tolerance] hp-train --lighthouse [--bind HOST:PORT] [--min_replicas N] runs torchft's
  lighthouse; start each replica group with --fault_tolerance.enable true
  --fault_tolerance.replica_id R --fault_tolerance.lighthouse http://HOST:PORT"""


def _quiet_known_warnings() -> None:
    # Advice aimed at framework authors, printed once per rank: the embedding output is never
    # modified in place, and the 2-D gradient-norm reduction is two small all-reduces.
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


# How each run of this process ended ("saved" / "unsaved" after SIGTERM, None when finished):
# read by _rank_main, whose ``main`` returns 0 either way under the launcher.
_signal_stops: list[str | None] = []


def _train(config: JobConfig) -> int:
    from hp_trainer.trainer import Trainer

    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    _signal_stops.append(trainer.stop_status)
    if trainer.stop_status is None or "TORCHELASTIC_RUN_ID" in os.environ:
        # under torchrun a rank's non-zero status makes the agent kill its peers while they
        # finish; the launcher reads the ranks' stopped.json instead
        return 0
    return _STOP_STATUS[trainer.stop_status]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hp-train``.

    ``hp-train --config debug`` trains the debug Llama 3 on as many local CPU/GPU ranks as the
    parallel degrees need, starting them with torch's elastic launcher (the agent
    ``torchrun`` runs) when it is not already running under a launcher (``torchrun``, Slurm +
    torchrun). The local ranks fork from a forkserver that imported the training stack once,
    instead of each importing it in an interpreter of its own.

    Args:
        argv: Arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The process exit status: 0 when the run finished, 1 when a rank failed, 2 for a bad
        configuration (nothing started), :data:`EXIT_STOPPED_SAVED` (75) when SIGTERM stopped
        it after a checkpoint of the last completed step was saved (run the same command again
        to resume), :data:`EXIT_STOPPED_UNSAVED` (143) when SIGTERM stopped it with
        checkpointing off. Ranks under an external ``torchrun`` exit 0 after a clean stop (a
        non-zero status would make the agent kill their peers); rank 0 writes
        ``<run folder>/stopped.json`` with the step and whether it was saved.

    See Also:
        :titan:`torchtitan.train.main`: TorchTitan's entry point (run via ``run_train.sh``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--lighthouse"]:  # torchft's lighthouse for fault-tolerant replica groups
        from hp_trainer.components.ft import run_lighthouse

        return run_lighthouse(args[1:])
    if "--help" in args or "-h" in args:
        print(ConfigManager().help_text())
        print(_LAUNCH_HELP)
        return 0
    rank = int(os.environ.get("RANK", "0"))
    try:
        launch_options, args = split_launch_options(args)
        config = ConfigManager().parse_args(args)
        launch = needs_launcher(config) or launch_options.multi_node
        if launch_options.multi_node and any(name in os.environ for name in _LAUNCHER_ENV):
            raise ValueError("--nnodes/--rdzv-endpoint given, but already under a launcher")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if launch:
            world = _nproc_per_node(config, launch_options.nnodes) * launch_options.nnodes
        report = preflight(config, world)
    except (ValueError, ImportError, FileNotFoundError) as exc:
        if rank == 0:
            print(f"hp-train: error: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        for note in report.notes:
            print(f"hp-train: note: {note}", file=sys.stderr, flush=True)
    args += report.overrides
    if launch:
        nproc = _nproc_per_node(config, launch_options.nnodes)
        where = ""
        if launch_options.multi_node:
            where = f" (node {launch_options.node_rank} of {launch_options.nnodes}, rendezvous "
            where += f"at {launch_options.rdzv_endpoint})"
        print(
            f"hp-train: starting {nproc} local ranks with torch's elastic launcher{where}",
            flush=True,
        )
        start = time.perf_counter()
        preload = [*_PRELOAD, *(["torchft"] if config.fault_tolerance.enable else [])]
        status = _launch(nproc, args, config.run_folder, launch_options, preload=preload)
        print(f"hp-train: finished in {time.perf_counter() - start:.1f} s", flush=True)
        return status
    if report.overrides:
        config = ConfigManager().parse_args(args)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[hp-train] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    _quiet_known_warnings()
    if config.job.print_config and rank == 0:
        print(json.dumps(config.to_dict(), indent=2))
    # under a launcher, record() writes the failing rank's traceback to the agent's error file
    return record(_train)(config) or 0


if __name__ == "__main__":
    sys.exit(main())
