"""CRC-32 (the zlib polynomial) of checkpoint bytes, hardware-accelerated when possible.

``isal`` (Intel ISA-L, a dependency of hp-dcp) computes the same CRC-32 as ``zlib`` about four
times faster with carry-less multiplication; where it cannot be imported ``zlib.crc32`` is used.
Both give identical values, so checkpoints verify the same way whichever is used.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable

Crc32 = Callable[..., int]


def _pick() -> tuple[Crc32, str]:
    try:
        mod = importlib.import_module("isal.isal_zlib")
    except ImportError:
        return zlib.crc32, "zlib"
    fn: Crc32 = mod.crc32
    return fn, "isal"


crc32, CRC32_BACKEND = _pick()
