# cffi modules can only be declared through setup(); everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["csrc/build_kernels.py:ffibuilder", "csrc/build_uring.py:ffibuilder"])
