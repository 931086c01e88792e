import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SEEDS = Path(__file__).resolve().parents[1].parent / "shared" / "seeds"


@pytest.fixture(scope="session")
def smollm_path():
    """The embedded default model (GGUF), or skip when the package is not installed."""
    from fastdecode.api import default_model_path
    from fastdecode.errors import ModelNotFoundError

    try:
        return default_model_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm(smollm_path):
    import fastdecode

    return fastdecode.load(str(smollm_path))
