import pytest

from engine.loader import load_model


@pytest.fixture(scope="session")
def loaded():
    """The bundled model, loaded once (float32 on the CPU backend)."""
    return load_model()
