import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import VARIANTS, build_model_dir  # noqa: E402

# Tiny matmuls: one thread each is far faster than two fighting over a shared, busy CPU.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """variant -> a tiny HF checkpoint directory (built once per session, lazily)."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[str, Path] = {}

    class Dirs:
        def __getitem__(self, variant: str) -> Path:
            if variant not in cache:
                cache[variant] = build_model_dir(root / variant, variant)
            return cache[variant]

    return Dirs()


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"]


__all__ = ["VARIANTS"]
