"""The math: C kernels behind ops.py, numpy references in ref.py, routing in moe.py."""
