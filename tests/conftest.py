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


@pytest.fixture(autouse=True, scope="session")
def _no_machine_profile(tmp_path_factory):
    """Tests never read the user's machine profile (`colibri tune` writes it under
    XDG_CONFIG_HOME): an empty config directory for the session, inherited by subprocesses."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))
    yield
    mp.undo()
