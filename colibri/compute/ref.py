"""numpy reference implementations of colibri's kernels (the oracles the C code is tested
against). Slow, obviously correct, float64 where it matters."""

from __future__ import annotations

import numpy as np

# ---- small ops and attention
