"""hp-kernels test configuration: the marker of the Triton interpreter tests."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "triton_interpret: runs Triton kernels under TRITON_INTERPRET=1 on CPU tensors "
        "(CI stage kernels-interpreter; skipped without triton)",
    )
