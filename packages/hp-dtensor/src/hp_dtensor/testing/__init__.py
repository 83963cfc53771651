"""The distributed test harness every hyper-parallel package uses.

A test decorated with :func:`distributed` runs on every rank of a *warm pool* of gloo worker
processes. Pools are kept per world size and reused across tests (spawning a process group costs
2.5-4 s here; a warm pool costs nothing), one pool alive at a time. Each job runs under a timeout
(default 60 s); a hung collective fails that test only, and the pool is killed and rebuilt.

How test functions reach the workers: by reference. A worker receives the function's module name,
the module's file and the function's qualified name, imports the module (by name, or from the file
when pytest's ``--import-mode=importlib`` gave it a name that is not importable) and looks the
function up. The workers inherit the parent's ``sys.path``, so the repository root and every
editable package are importable there. Consequences: the test function and every helper it calls
must be defined at module level; arguments and return values must be picklable.

Between tests the default process group is reused; the harness restores what a test may leave
behind: RNG states, default dtype, grad mode, deterministic-algorithms flag, intra-op threads
(one per rank), and process groups the test created with options are destroyed (groups with
default options are kept and handed to a later test's equal request). After a failure on any
rank the whole pool is rebuilt, so half-finished collectives cannot leak into the next test.

Meshes and DTensor's caches: a mesh built with default backend options in a later test is the
object an earlier test built for an equal mesh, initialized again (fresh state, same identity),
so DTensor's sharding-propagation caches, keyed by mesh equality, stay valid across tests and
are not recomputed. They are cleared (and the meshes forgotten) after a test that destroyed a
process group, made groups with options, built an equal mesh twice or changed a sharding rule.
A test that must see new mesh objects and empty caches passes ``fresh_meshes=True``; the
environment variable ``HP_TESTING_FRESH_MESHES=1`` does it for every job.

Foreach ops (optimizers, gradient clipping) are sharded element by element, and DTensor expands
each element's strategies over the mesh again for every new parameter list. Workers memoize that
expansion by value (mesh, op, argument shardings and metadata, strategies), cleared with DTensor's
caches; results are copies, so nothing a caller writes leaks into a later answer.
``HP_TESTING_NO_EXPANSION_MEMO=1`` turns the memo off. Workers also memoize DTensor's output
metadata propagation (a fake-tensor run) by the op and the arguments' global metadata, which the
layouts of one model share; ``HP_TESTING_NO_META_MEMO=1`` turns that memo off.

Workers fork from one fork server per session, which imports torch, hp_dtensor, pytest, the
stack's packages the tests imported and what :func:`preload_in_workers` names, once.

Example:
    .. code-block:: python

        import torch
        import torch.distributed as dist
        from hp_dtensor.testing import distributed, rank_seed


        @distributed(world_size=3)
        def test_all_reduce_sums() -> None:
            torch.manual_seed(rank_seed(0))  # different data on each rank
            x = torch.randn(4)
            total = x.clone()
            dist.all_reduce(total)
            ...

Test rules for every package: tiny models (dim <= 96, <= 3 blocks, sequence <= 32) unless a test
needs more; tests grouped by world size (the pytest plugin orders them so); world size 8 only with
:func:`fake_world` or in a handful of tests; ``torch.compile`` checks with ``backend="aot_eager"``;
tests that kill processes run in their own subprocesses, outside the pool.

See Also:
    :pt:`torch.testing._internal.common_distributed.MultiProcessTestCase`: PyTorch's own harness,
    which spawns a process group per test.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, ParamSpec, TypeVar

from hp_dtensor.testing import _fork_server
from hp_dtensor.testing._pool import (
    MANAGER,
    DistributedTestError,
    DistributedTestTimeoutError,
    PoolStats,
    in_worker,
)
from hp_dtensor.testing.device_groups import (
    DeviceGroupChecker,
    HostTensorOnDeviceGroupError,
    check_device_groups,
)
from hp_dtensor.testing.host_syncs import HostSyncCounter, count_host_syncs

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DeviceGroupChecker",
    "DistributedTestError",
    "DistributedTestTimeoutError",
    "HostSyncCounter",
    "HostTensorOnDeviceGroupError",
    "PoolStats",
    "check_device_groups",
    "count_host_syncs",
    "distributed",
    "fake_world",
    "fork_server_preload",
    "load_test_module",
    "pool_stats",
    "preload_in_workers",
    "rank_seed",
    "run_distributed",
    "seed_all",
    "shutdown_pool",
    "start_fork_server",
]

#: Seconds a distributed test may run on its ranks before the pool is killed.
DEFAULT_TIMEOUT_S = 60.0
#: Set to ``1`` to run every job with ``fresh_meshes=True`` (what the harness did before it kept
#: meshes and DTensor's caches: for comparisons and for bisecting a suspected stale entry).
FRESH_MESHES_ENV = "HP_TESTING_FRESH_MESHES"

P = ParamSpec("P")
R = TypeVar("R")


def run_distributed(
    fn: Callable[..., R],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    fresh_meshes: bool = False,
    **kwargs: Any,
) -> list[R]:
    """Run a module-level function on every rank of the warm pool for ``world_size``.

    Args:
        fn: A module-level function (or a function decorated with :func:`distributed`).
        world_size: Number of ranks (a pool of this size is started if none is warm).
        *args: Positional arguments passed to ``fn`` on every rank (picklable).
        timeout: Seconds before the job is declared hung and the pool is killed.
        fresh_meshes: Build this job's device meshes as new objects and start and end it with
            empty DTensor sharding caches, instead of sharing meshes and caches with the jobs
            before and after it (see "Meshes and DTensor's caches" above).
        **kwargs: Keyword arguments passed to ``fn`` on every rank (picklable).

    Returns:
        The return value of ``fn`` on each rank, in rank order.

    Raises:
        DistributedTestError: ``fn`` raised on some rank (the message names the rank and holds
            its traceback).
        DistributedTestTimeoutError: some rank did not finish within ``timeout`` seconds.
        ValueError: ``world_size`` is below 1 or ``fn`` is not a module-level function.

    See Also:
        :pt:`torch.multiprocessing.spawn`: starts processes per call instead of reusing a pool.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if "<locals>" in getattr(fn, "__qualname__", "<locals>"):
        raise ValueError(
            f"{fn!r} must be defined at module level: workers import it by qualified name"
        )
    module = sys.modules[fn.__module__]
    fresh_meshes = fresh_meshes or os.environ.get(FRESH_MESHES_ENV) == "1"
    pool = MANAGER.get(world_size)
    MANAGER.stats.jobs += 1
    return pool.run(
        fn.__module__,
        getattr(module, "__file__", None),
        fn.__qualname__,
        args,
        kwargs,
        timeout,
        {"fresh_meshes": fresh_meshes},
    )


def distributed(
    world_size: int, *, timeout: float = DEFAULT_TIMEOUT_S, fresh_meshes: bool = False
) -> Callable[[Callable[P, R]], Callable[P, None]]:
    """Decorate a test so that its body runs on ``world_size`` gloo ranks.

    pytest parameters (``@pytest.mark.parametrize``) are passed to every rank. The body finds the
    default process group initialized, with one intra-op thread per rank.

    Args:
        world_size: Number of ranks.
        timeout: Seconds before the test fails as hung (the pool is rebuilt for the next test).
        fresh_meshes: The test's meshes are new objects and DTensor's caches start and end
            empty (see :func:`run_distributed`).

    Returns:
        A decorator. The decorated function carries ``__hp_world_size__`` so the pytest plugin can
        group tests by world size.

    See Also:
        :pt:`torch.testing._internal.common_distributed.MultiProcessTestCase`
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, None]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
            if in_worker():
                fn(*args, **kwargs)
                return
            run_distributed(
                wrapper, world_size, *args, timeout=timeout, fresh_meshes=fresh_meshes, **kwargs
            )

        wrapper.__hp_world_size__ = world_size  # type: ignore[attr-defined]
        return wrapper

    return decorate


def rank_seed(seed: int = 0) -> int:
    """A seed that differs on each rank (``seed`` on a process without a process group).

    Use it for the *data* of a test, so that identical data on every rank cannot hide a
    reduction bug; seed model construction with the plain ``seed`` so models agree.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    return seed + 1009 * (rank + 1)


def seed_all(seed: int) -> None:
    """Seed torch's CPU and accelerator generators, ``random`` and (if loaded) numpy."""
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % (2**32))


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A single-process default process group of ``world_size`` ranks on the "fake" backend.

    Collectives return at once without moving data, so only shapes, meshes and metadata are
    meaningful: use it to test mesh and plan logic for up to 64 (or more) ranks without processes.

    Args:
        world_size: Ranks the fake group pretends to have.
        rank: The rank this process plays.

    Raises:
        RuntimeError: a default process group already exists in this process.

    See Also:
        :pt:`torch.testing._internal.distributed.fake_pg.FakeStore`
    """
    import torch.distributed as dist

    from hp_dtensor._torch_compat import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a default process group")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def load_test_module(path: str | os.PathLike[str], name: str) -> ModuleType:
    """Import a helper file that sits beside the tests, once per process, under ``name``.

    Test directories are not packages and pytest's ``--import-mode=importlib`` gives test modules
    names that a sibling ``import`` cannot resolve. Registering the helper under a stable module
    name also lets objects defined in it (models, dataclasses) be pickled between the pytest
    process and the workers, which load it the same way.

    Args:
        path: The helper file, usually ``Path(__file__).with_name("_helpers.py")``.
        name: A module name unique in the repository, e.g. ``"hp_fsdp_tests_helpers"``.

    Returns:
        The loaded module (the same object on every call in this process).

    Raises:
        ImportError: ``path`` cannot be loaded as a Python module.

    See Also:
        ``importlib.util.spec_from_file_location``: the loading mechanism.
    """
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, os.fspath(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {os.fspath(path)!r} as module {name!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def pool_stats() -> PoolStats:
    """Start-up times per pool and the number of jobs run in this process so far."""
    return MANAGER.stats


def preload_in_workers(*modules: str, files: Sequence[str | os.PathLike[str]] = ()) -> None:
    """Have the pool workers' fork server import ``modules`` and run ``files`` once, at its start.

    Workers are forked from one multiprocessing fork server per test session, which imports
    torch, hp_dtensor and the stack's packages the test process has imported. A module a test
    needs on its ranks beyond those (``datasets``, the ``torch._inductor`` pieces that the first
    ``torch.compile`` loads, ...) is otherwise imported by every worker of every pool, again
    after each pool start-up; state built at import (a warm cache) is built again likewise. A
    file runs in the server after the modules (``runpy.run_path``): what it leaves in imported
    modules (a process-wide cache filled, say) every forked process inherits.

    Call this at collection, from a ``conftest.py`` or a test module, which pytest imports
    before the pytest plugin starts the server. A module that fails with ``ImportError`` is left
    to the workers (multiprocessing's fork server skips it); any other exception at import
    stops the server, and every pool start-up fails. A file that raises is reported on stderr
    and skipped. Preload nothing that initialises a device runtime: every worker would inherit
    it.

    Args:
        *modules: Module names, as ``importlib.import_module`` takes them.
        files: Keyword-only; paths of Python files to run in the server.

    Raises:
        TypeError: A module name that is not a non-empty string.
        ValueError: A file that does not exist.

    Warns:
        RuntimeWarning: The fork server has already started; nothing new is recorded (the
            workers do without it).

    See Also:
        :py:meth:`multiprocessing.context.BaseContext.set_forkserver_preload`: what it sets.
    """
    _fork_server.request(modules, tuple(files))


def fork_server_preload() -> list[str]:
    """The modules the workers' fork server imports when it starts.

    Returns:
        torch, ``torch.distributed.tensor`` and hp_dtensor; the stack's packages the test
        process has imported; the modules :func:`preload_in_workers` was given; then the module
        that runs its files, if any; in that order.

    See Also:
        :py:meth:`multiprocessing.context.BaseContext.set_forkserver_preload`: what it feeds.
    """
    return _fork_server.preload()


def start_fork_server() -> None:
    """Start the workers' fork server now, if it has not started, without waiting for it.

    The pytest plugin calls this when collection ends, if a collected test uses the pools: the
    server's imports then run beside the single-process tests (which come first and leave a core
    idle) instead of holding up the first distributed test. A test helper that forks its own
    processes from the same server (``multiprocessing.get_context("forkserver")``) calls it
    first, so that the server has the session's preload whichever starts it.

    See Also:
        :py:func:`multiprocessing.forkserver.ensure_running`: what it calls.
    """
    _fork_server.start()


def shutdown_pool() -> None:
    """Stop the live pool, if any (the pytest plugin calls this at session end)."""
    MANAGER.shutdown()
