"""Triton kernel tests written as ordinary pytest files.

Collected when this process runs Triton's CPU interpreter (``TRITON_INTERPRET=1``: tests/test_kernels_interpreted.py
runs this package once in such a subprocess) or CUDA is available (the compiled kernels on the GPU; tests marked
``helpers.needs_interpreter`` skip there). Elsewhere tests/conftest.py leaves the package out of the collection, and
tests/kernel_tests/conftest.py skips its tests when the package is named explicitly.
"""
