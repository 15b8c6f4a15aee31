"""colibri: run Mixture-of-Experts language models larger than RAM.

The dense part of a model stays resident; routed experts are streamed from NVMe on demand
(io_uring, O_DIRECT, a slab pool behind an expert cache), and C kernels do the math.
"""

__version__ = "0.1.0"

from colibri.engine import Engine, SyncEngine, Token, open_engine

__all__ = ["Engine", "SyncEngine", "Token", "open_engine"]
