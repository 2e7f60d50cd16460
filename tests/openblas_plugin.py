"""Pytest plugin (``-p tests.openblas_plugin`` in pyproject's addopts): run the suite under
OpenBLAS like the ``kvarn`` command does (see server/blas.py).

MLX's Linux CPU wheel links a reference BLAS; with Debian's OpenBLAS preloaded the bundled
model runs ~10x faster, which keeps the suite inside CI's time. A plugin named with ``-p`` is
imported before pytest captures output, so the one re-exec keeps the terminal.
"""

from server.blas import maybe_reexec_with_openblas

maybe_reexec_with_openblas()
