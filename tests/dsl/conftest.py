"""tests/dsl: every test process gets its own ninefold cache, so CUDA tests that tune kernels on a
GPU shared by parallel workers never leave their picks in the user's cache."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _own_ninefold_cache(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path_factory.mktemp("ninefold-cache")))
    yield
    patch.undo()
