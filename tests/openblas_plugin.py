"""Pytest plugin (``-p tests.openblas_plugin`` in pyproject's addopts): run the suite under
OpenBLAS like the ``kvarn`` command does (see server/blas.py).

MLX's Linux CPU wheel links a reference BLAS; with Debian's OpenBLAS preloaded the bundled
model runs ~10x faster, which keeps the suite inside CI's time. A plugin named with ``-p`` is
imported before pytest captures output, so the one re-exec keeps the terminal.

``@pytest.mark.reference_blas``: a test that compares two compute paths of a *quantized* cache
whose matmuls have different row counts (a row alone vs in a batch, a prompt whole vs in chunks,
a restored row vs a recomputed one) runs in a child pytest without OpenBLAS. OpenBLAS picks its
kernels and blocking by the row count and the processor, so the same row's keys and values
differ in their last bits between the two paths; a 4- or 2-bit code that sits within that noise
of a rounding boundary then flips, and one flipped code moves the logits by 0.05-0.5: on one
machine a test passes, on the next it fails, and neither says anything about the cache. MLX's
reference BLAS sums every output element in the same order whatever the row count, so there
the two paths feed the quantizer the same values and such a test checks exactly what it claims
(the cache's view and bookkeeping). Measured: ``test_slots``'s affine arm gave 0.092 against its
0.05 bound under this machine's OpenBLAS and passes under the reference BLAS.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server.blas import DISABLE_ENV, maybe_reexec_with_openblas, openblas_active

# One OpenBLAS thread: the suite runs one pytest-xdist worker a core (pyproject's addopts). Two
# threads in one process bought 13% of wall time on this project's 2-core CI machine for 46% more
# CPU (its spinning threads: 24 s of system time in 43 s of tests), so workers with two threads
# each would fight over the cores. The ``kvarn`` command keeps OpenBLAS's default.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
maybe_reexec_with_openblas()

MARK = "reference_blas"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}: run this test in a child pytest under MLX's reference BLAS "
                                       "(tests/openblas_plugin.py says why)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if pyfuncitem.get_closest_marker(MARK) is None or not openblas_active():
        return None  # runs here as usual (in the child, or where OpenBLAS is not preloaded)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KVARN_OPENBLAS_REEXEC")}
    env[DISABLE_ENV] = "1"
    root = str(pyfuncitem.config.rootpath)
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                            pyfuncitem.nodeid], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    if child.returncode != 0 or " passed" not in child.stdout:
        pytest.fail(f"under the reference BLAS (exit {child.returncode}):\n{child.stdout[-6000:]}\n{child.stderr[-2000:]}",
                    pytrace=False)
    return True
