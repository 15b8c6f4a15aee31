"""Fixtures shared by the test suite."""

from __future__ import annotations

import pytest

from colibri.compute import ops


def _isa_param(level: ops.ISA):
    reason = f"{level.name.lower()}: not supported by this CPU (best is {ops.best_isa().name})"
    return pytest.param(
        level,
        id=level.name.lower(),
        marks=pytest.mark.skipif(level > ops.best_isa(), reason=reason),
    )


@pytest.fixture(params=[_isa_param(level) for level in ops.ISA])
def isa(request):
    """Run the test at one instruction-set level (skipped where the CPU cannot), restoring the
    previous level after."""
    before = ops.isa()
    ops.set_isa(request.param)
    yield request.param
    ops.set_isa(before)
