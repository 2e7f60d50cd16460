import os

from server.blas import find_openblas, openblas_active


def test_suite_runs_under_openblas_when_installed():
    lib = find_openblas()
    if lib is None:
        assert not openblas_active()
    else:
        assert str(lib) in os.environ["LD_PRELOAD"]
