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


@pytest.fixture(scope="session")
def smollm2():
    """The real default model's GGUF file (SmolLM2-135M-Instruct); skips where it is not available."""
    from ninefold.llm import hub

    try:
        return hub.resolve_model(None)
    except hub.ModelNotAvailable as error:
        pytest.skip(f"SmolLM2 GGUF not cached and not fetchable here: {error}")


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2):
    """transformers' tokenizer of the same GGUF file (the reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)


@pytest.fixture(scope="session")
def ours(smollm2):
    """ninefold's tokenizer of the GGUF file."""
    from ninefold.llm.gguf import load_gguf_tokenizer
    from ninefold.llm.tokenizer import Tokenizer

    return Tokenizer(*load_gguf_tokenizer(smollm2))
