"""Count the operations that would stop the host until an accelerator catches up.

On a GPU or NPU, ``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``, ``nonzero``, boolean-mask
indexing, ``repeat_interleave`` without ``output_size``, blocking device-to-host copies and
tensors built from Python data make the host wait for the device: the CPU can no longer run ahead
and the overlap of communication with compute disappears. A CPU test cannot feel any of this, so
:func:`count_host_syncs` counts these operations instead, per op name and per Python call site,
on any device (CPU tensors stand for device tensors), under autograd (forward and backward) and on
every rank of the distributed harness.

How it sees them: a dispatch mode (the level below autograd, so backward ops are seen as well:
the autograd engine carries the region's modes into the threads it runs backward on) counts the
ATen ops that synchronize (entering ``torch.library`` custom ops such as hp-kernels' MoE
permutation, so the ATen ops their kernels run are seen too), and a torch-function mode
counts what never reaches the dispatcher on a CPU tensor: ``Tensor.tolist()``,
``Tensor.cpu()`` and tensors created from Python data (``torch.tensor``, ``torch.as_tensor``,
``torch.asarray``, ``Tensor.new_tensor``). One user-level call counts once (``.tolist()`` on a
GPU tensor is one event, not a copy plus a read).

What counts as a device tensor: by default every tensor that is neither on the meta device nor
in pinned host memory, whatever machine runs the test (so a CPU test stands in for the device and
a test counts the same on a GPU machine). Pass ``device_tensors=`` (a predicate) to say otherwise,
or ``host_tensors=`` to exempt tensors that live on the host on an accelerator too (PyTorch's
eager optimizers keep their ``step`` counters there and read them with ``.item()``).

What it does not see: host waits on streams and events (``Event.synchronize``,
``Stream.synchronize``, ``torch.accelerator.synchronize``: observe those with
:class:`hp_dtensor.device.RecordingStream`), syncs inside compiled graphs, and torch-function
level calls (``.tolist()``, ``torch.tensor``) made from inside another torch function's Python
implementation, and ``torch.from_numpy`` / ``torch.frombuffer`` (zero-copy views of host
memory that PyTorch does not route through torch-function modes). On a CPU tensor
``.to("cpu")`` is not a copy and cannot be told from ``.to(compute_device)``; write ``.cpu()``
for a host-ward copy (it is counted) or declare the devices with ``device_tensors=``.

Example:
    .. code-block:: python

        from hp_dtensor.testing import count_host_syncs

        with count_host_syncs() as syncs:
            out = moe(x)
            out.sum().backward()
        syncs.assert_at_most(1, what="one MoE layer, forward and backward")
        print(syncs.by_op, syncs.by_site)

See Also:
    :pt:`torch.cuda.set_sync_debug_mode`: PyTorch's runtime check on a real GPU (warns or raises
    at each synchronizing CUDA call).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hp_dtensor._torch_compat import TorchDispatchMode, require, tree_flatten

__all__ = ["HostSyncCounter", "count_host_syncs"]

#: Op name of a device-to-host copy in :attr:`HostSyncCounter.by_op`.
COPY_D2H = "copy_d2h"
#: Op name of a tensor created from Python data (an implicit host-to-device copy).
TENSOR_FROM_PYTHON = "tensor_from_python"
#: Op name of ``Tensor.tolist()`` (one device-to-host read of the whole tensor).
TOLIST = "tolist"

_aten = torch.ops.aten

# ATen ops that always wait for the device: their output (a Python scalar, or a shape) depends on
# device data.
_ALWAYS = {
    _aten._local_scalar_dense: "aten._local_scalar_dense",
    _aten.nonzero: "aten.nonzero",
    _aten.masked_select: "aten.masked_select",
    _aten._unique: "aten.unique",
    _aten._unique2: "aten.unique",
    _aten.unique_dim: "aten.unique",
    _aten.unique_consecutive: "aten.unique",
    _aten.unique_dim_consecutive: "aten.unique",
    _aten.equal: "aten.equal",
    _aten.bincount: "aten.bincount",
}
_REPEAT_INTERLEAVE = _aten.repeat_interleave
_INDEX = {_aten.index: "aten.index[bool]"}
_INDEX_PUT = {
    _aten.index_put: "aten.index_put[bool]",
    _aten.index_put_: "aten.index_put[bool]",
    _aten._index_put_impl_: "aten.index_put[bool]",
}
_COPIES = {_aten.copy_, _aten._to_copy}

# Ops of these namespaces are PyTorch's own; an op of any other namespace (a ``torch.library``
# custom op, e.g. ``hp_kernels::permute_tokens``) is entered, so the ops its kernel runs count.
_BUILTIN_NAMESPACES = frozenset(
    {"aten", "prim", "prims", "c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"}
)
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_dispatch_keys = require("hp-dtensor", "torch._C._dispatch_keys")
_BELOW_PYTHON = require("hp-dtensor", "torch._C._dispatch_keyset_full_after")(
    require("hp-dtensor", "torch._C.DispatchKey").Python
)

_FROM_PYTHON: frozenset[Any] = frozenset(
    {
        torch.tensor,
        torch.as_tensor,
        torch.asarray,
        torch.Tensor.new_tensor,
    }
)
_TOLIST = torch.Tensor.tolist
_CPU = torch.Tensor.cpu

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)


def _default_device_tensor(tensor: torch.Tensor) -> bool:
    if tensor.device.type == "meta":
        return False
    if tensor.device.type == "cpu" and torch.accelerator.is_available():
        return not _is_pinned(tensor)
    return True


def _is_pinned(tensor: torch.Tensor) -> bool:
    if tensor.device.type != "cpu" or not torch.accelerator.is_available():
        return False
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:  # a tensor subclass without storage
        return False


def _site_of(frame: FrameType | None) -> str:
    """``path:LINE`` of the innermost frame outside torch and this module."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_TORCH_DIR) and os.path.abspath(filename) != _THIS_FILE:
            try:
                shown = os.path.relpath(filename)
            except ValueError:  # another drive
                shown = filename
            if shown.startswith(".." + os.sep):
                shown = filename
            return f"{shown}:{frame.f_lineno}"
        frame = frame.f_back
    return "<no python frame>"


class HostSyncCounter:
    """The host synchronizations seen in one :func:`count_host_syncs` region.

    Counts are live (readable inside the region) and safe to read from any thread. Each event
    is ``(op, site)``: ``op`` is an ATen op name (``"aten._local_scalar_dense"``,
    ``"aten.nonzero"``, ``"aten.masked_select"``, ``"aten.unique"``,
    ``"aten.repeat_interleave"``, ``"aten.index[bool]"``, ``"aten.index_put[bool]"``,
    ``"aten.equal"``, ``"aten.bincount"``) or one of ``"copy_d2h"``, ``"tolist"``,
    ``"tensor_from_python"``; ``site`` is ``"path/to/file.py:LINE"`` of the innermost frame
    outside torch and this module (relative to the working directory when under it).

    Args:
        device_tensors: See :func:`count_host_syncs`.
        host_tensors: See :func:`count_host_syncs`.

    Raises:
        TypeError: See :func:`count_host_syncs`.

    See Also:
        :pt:`torch.cuda.set_sync_debug_mode`: the runtime check on a real GPU.
    """

    def __init__(
        self,
        *,
        device_tensors: Callable[[torch.Tensor], bool] | None = None,
        host_tensors: Iterable[torch.Tensor] = (),
    ) -> None:
        if device_tensors is not None and not callable(device_tensors):
            raise TypeError(
                f"device_tensors must be a callable Tensor -> bool or None, got "
                f"{type(device_tensors).__name__}"
            )
        host = list(host_tensors)
        for tensor in host:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"host_tensors must hold tensors, got {type(tensor).__name__} among them"
                )
        self._predicate = device_tensors or _default_device_tensor
        self._host = host
        self._lock = threading.Lock()
        self._events: list[tuple[str, str]] = []
        self._local = threading.local()
        self._mode = _SyncDispatchMode(self)

    # -- results -------------------------------------------------------------------------------

    @property
    def events(self) -> list[tuple[str, str]]:
        """``(op, site)`` of each synchronization, in order (a copy)."""
        with self._lock:
            return list(self._events)

    @property
    def total(self) -> int:
        """How many synchronizations were seen."""
        with self._lock:
            return len(self._events)

    @property
    def by_op(self) -> collections.Counter[str]:
        """Synchronizations per op name."""
        return collections.Counter(op for op, _ in self.events)

    @property
    def by_site(self) -> collections.Counter[str]:
        """Synchronizations per call site (``"path/to/file.py:LINE"``)."""
        return collections.Counter(site for _, site in self.events)

    def summary(self) -> str:
        """A readable list of the synchronizations, grouped by op and site, most frequent first."""
        pairs = collections.Counter(self.events)
        if not pairs:
            return "no host synchronizations"
        lines = [f"{self.total} host synchronization(s):"]
        lines += [f"  {count} x {op} at {site}" for (op, site), count in pairs.most_common()]
        return "\n".join(lines)

    def assert_at_most(self, n: int, what: str = "the region") -> None:
        """Fail when more than ``n`` synchronizations were seen.

        Args:
            n: The budget (>= 0).
            what: Words naming the region, for the message.

        Raises:
            AssertionError: over budget; the message lists every synchronization and its site.
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"the budget n must be >= 0, got {n}")
        total = self.total
        if total > n:
            raise AssertionError(
                f"{what}: {total} host synchronizations, budget {n}\n{self.summary()}"
            )

    def __repr__(self) -> str:
        return f"HostSyncCounter(total={self.total}, by_op={dict(self.by_op)})"

    # -- recording -----------------------------------------------------------------------------

    def _is_device(self, tensor: torch.Tensor) -> bool:
        if any(tensor is host for host in self._host):
            return False
        return bool(self._predicate(tensor))

    def _any_device(self, values: Any) -> bool:
        leaves, _ = tree_flatten(values)
        return any(isinstance(v, torch.Tensor) and self._is_device(v) for v in leaves)

    def _suppressed(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def _counted_call(self) -> Iterator[None]:
        """Ops run inside a call already counted at the torch-function level are not recounted."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def _record(self, op: str) -> None:
        site = _site_of(sys._getframe(1))
        with self._lock:
            self._events.append((op, site))

    def _dispatch_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._suppressed():
            return func(*args, **kwargs)
        packet = func.overloadpacket
        name = _ALWAYS.get(packet)
        if name is not None:
            if self._any_device((args, kwargs)):
                self._record(name)
            return func(*args, **kwargs)
        if packet is _REPEAT_INTERLEAVE:
            if kwargs.get("output_size") is None and self._any_device((args, kwargs)):
                repeats = args[0] if func is _aten.repeat_interleave.Tensor else args[1]
                if isinstance(repeats, torch.Tensor):
                    self._record("aten.repeat_interleave")
            return func(*args, **kwargs)
        name = _INDEX.get(packet) or _INDEX_PUT.get(packet)
        if name is not None:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in indices
            ) and self._any_device(args[0]):
                self._record(name)
            return func(*args, **kwargs)
        if func.namespace not in _BUILTIN_NAMESPACES:
            return self._enter_custom_op(func, args, kwargs)
        if packet in _COPIES:
            out = func(*args, **kwargs)
            src = args[1] if packet is _aten.copy_ else args[0]
            dst = args[0] if packet is _aten.copy_ else out
            non_blocking = kwargs.get(
                "non_blocking", args[2] if packet is _aten.copy_ and len(args) > 2 else False
            )
            if self._is_d2h(src, dst, bool(non_blocking)):
                self._record(COPY_D2H)
            return out
        return func(*args, **kwargs)

    def _enter_custom_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a custom op's kernel with the counting mode active, so its own ops are seen."""
        tensors = [
            leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)
        ]
        if not tensors or any(type(t) not in _PLAIN_TENSOR_TYPES for t in tensors):
            return func(*args, **kwargs)  # subclasses (DTensor) handle the op themselves
        keys = _dispatch_keys(tensors[0])
        for tensor in tensors[1:]:
            keys = keys | _dispatch_keys(tensor)
        with self._mode:
            return func.redispatch(keys & _BELOW_PYTHON, *args, **kwargs)

    def _is_d2h(self, src: Any, dst: Any, non_blocking: bool) -> bool:
        if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
            return False
        if not self._is_device(src):
            return False
        to_host = (
            src.device.type not in ("cpu", "meta") and dst.device.type == "cpu"
        ) or not self._is_device(dst)
        if not to_host:
            return False
        # An asynchronous copy into pinned memory does not block the host.
        return not (non_blocking and _is_pinned(dst))

    def _function_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._suppressed():
            return func(*args, **kwargs)
        op: str | None = None
        if func in _FROM_PYTHON:
            data = args[1] if func is torch.Tensor.new_tensor else (args[0] if args else None)
            if data is None:
                data = kwargs.get("data", kwargs.get("obj"))
            # ``device="cpu"`` spelled as a string asks for a host tensor on any machine (as
            # PyTorch's optimizers do for their step increments): no host-to-device copy.
            if not isinstance(data, torch.Tensor) and kwargs.get("device") != "cpu":
                op = TENSOR_FROM_PYTHON
        elif func is _TOLIST:
            if self._is_device(args[0]):
                op = TOLIST
        elif func is _CPU and self._is_device(args[0]) and not _is_pinned(args[0]):
            op = COPY_D2H
        if op is None:
            return func(*args, **kwargs)
        self._record(op)
        with self._counted_call():
            return func(*args, **kwargs)


class _SyncDispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counter = counter

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.counter._dispatch_op(func, args, kwargs or {})


class _SyncFunctionMode(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.counter._function_call(func, args, kwargs or {})


@contextlib.contextmanager
def count_host_syncs(
    *,
    device_tensors: Callable[[torch.Tensor], bool] | None = None,
    host_tensors: Iterable[torch.Tensor] = (),
) -> Iterator[HostSyncCounter]:
    """Count the operations in the region that would synchronize the host with an accelerator.

    Counted (once per user-level call): ``aten._local_scalar_dense`` (``.item()``, ``int(t)``,
    ``float(t)``, ``bool(t)``, ``if t:``), ``Tensor.tolist()``, ``nonzero`` (and ``torch.where``
    with one argument, ``argwhere``), ``masked_select``, ``unique`` (every variant),
    ``repeat_interleave`` with tensor repeats and no ``output_size``, indexing and index-assignment
    with a boolean mask (``x[mask]``, ``x[mask] = v``), ``equal``, ``bincount``, blocking
    device-to-host copies (``.cpu()``, ``copy_``/``.to`` from an accelerator to the host, or
    into a tensor ``device_tensors`` says is on the host; a non-blocking copy into pinned memory
    is not a sync), and tensors created from Python data (``torch.tensor``, ``as_tensor``,
    ``asarray``, ``new_tensor``: an implicit host-to-device copy; not when ``device="cpu"`` is
    spelled as a string, which asks for a host tensor on any machine). Not counted: anything else
    (a matmul, a linear layer forward and backward, collectives, ``nonzero_static``,
    ``torch._assert_async``).

    Ops run by backward inside the region are counted (the autograd engine carries the region's
    modes to its worker threads); ops run by other threads the region's thread starts are not.
    Inside the distributed harness each rank counts its own.

    Args:
        device_tensors: Says whether a tensor stands for a device tensor (only ops that read a
            device tensor are counted). Default: every tensor not on the meta device and not in
            pinned host memory, so a CPU test stands in for the accelerator. Example for a real
            GPU run that should ignore host tensors: ``lambda t: t.device.type != "cpu"``.
        host_tensors: Tensors that live on the host on an accelerator too, exempted by identity
            (e.g. the ``step`` counters of ``torch.optim.Adam``, which it reads with ``.item()``).

    Yields:
        The :class:`HostSyncCounter`, filled as the region runs.

    Raises:
        TypeError: ``device_tensors`` is not callable, or ``host_tensors`` holds a non-tensor.

    Example:
        .. code-block:: python

            with count_host_syncs() as syncs:
                loss = model(x).sum()
                loss.backward()
            syncs.assert_at_most(0, what="one training step")

    See Also:
        :pt:`torch.cuda.set_sync_debug_mode`: the runtime check on a real GPU.
    """
    counter = HostSyncCounter(device_tensors=device_tensors, host_tensors=host_tensors)
    with _SyncFunctionMode(counter), counter._mode:
        yield counter
