"""Process groups a worker keeps between jobs and hands out again for an equal request.

Every test builds its meshes again, and every mesh axis is a ``new_group`` on every rank: a
store rendezvous and a TCP pair per peer for each group (a ``[2, 2]`` mesh makes four, its
flattened axes more), three gloo threads each, and after ``destroy_process_group`` threads that
live on while anything references the group. A worker installs one :class:`GroupCache`:
``new_group`` with default options (no timeout, no ``pg_options``, global synchronization)
returns the group an earlier job made for the same ranks and backend. Every rank of a pool runs
the same jobs in the same order, so every rank hits or misses together. A group made with a
timeout or options (tests that provoke a timeout may leave its pairs closed) is made fresh and
destroyed after its job as before; a group a test destroys itself leaves the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class GroupCache:
    """``new_group`` results of a worker, kept across jobs (installed once per worker)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[tuple[int, ...] | None, str | None], Any] = {}
        #: ``destroy_process_group`` calls so far (by tests and by the harness)
        self.destroyed = 0

    def kept(self) -> set[Any]:
        """The kept groups (the harness does not destroy them after a job)."""
        return set(self._groups.values())

    def install(self) -> None:
        """Route ``torch.distributed.new_group`` / ``destroy_process_group`` through the cache."""
        import torch.distributed as dist
        import torch.distributed.device_mesh as device_mesh
        import torch.distributed.distributed_c10d as c10d

        new_group = self._caching(c10d.new_group)
        destroy = self._forgetting(c10d.destroy_process_group)
        for module in (dist, c10d, device_mesh):
            if hasattr(module, "new_group"):
                module.new_group = new_group  # type: ignore[attr-defined]
        for module in (dist, c10d):
            module.destroy_process_group = destroy  # type: ignore[attr-defined]

    def _caching(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def new_group(
            ranks: Any = None,
            timeout: Any = None,
            backend: Any = None,
            pg_options: Any = None,
            use_local_synchronization: bool = False,
            group_desc: str | None = None,
            device_id: Any = None,
            sort_ranks: bool = True,
        ) -> Any:
            plain = (
                timeout is None
                and pg_options is None
                and not use_local_synchronization
                and device_id is None
            )
            if not plain:
                return original(
                    ranks=ranks,
                    timeout=timeout,
                    backend=backend,
                    pg_options=pg_options,
                    use_local_synchronization=use_local_synchronization,
                    group_desc=group_desc,
                    device_id=device_id,
                    sort_ranks=sort_ranks,
                )
            members = None if ranks is None else tuple(sorted(ranks) if sort_ranks else ranks)
            key = (members, None if backend is None else str(backend).lower())
            group = self._groups.get(key)
            if group is not None:
                return group
            group = original(
                ranks=ranks, backend=backend, group_desc=group_desc, sort_ranks=sort_ranks
            )
            self._groups[key] = group
            return group

        return new_group

    def _forgetting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def destroy_process_group(group: Any = None) -> None:
            self.destroyed += 1
            if group is None:
                self._groups.clear()
            else:
                self._groups = {k: g for k, g in self._groups.items() if g is not group}
            original(group)

        return destroy_process_group
