"""A tiny random Llama target and a random hidden-state head for it, saved as `load_eagle` reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.eagle import EagleConfig, EagleHead, save_eagle
from models.loader import load_model
from tests.models.hf_fixtures import make_family_checkpoint

VOCAB = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A 32-wide model is all per-op overhead: a second thread only adds wake-ups (imported by
    the modules that run these models, where it applies to each test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sharp_init(model) -> None:
    """N(0, 1) embeddings, N(0, 0.35) head, N(0, 0.2) elsewhere (norms at 1): a next-token law that
    is neither flat nor near-deterministic and depends on the context."""
    for name, param in model.named_parameters():
        if "norm" not in name:
            param.normal_(0, 1.0 if "embed" in name else 0.35 if "lm_head" in name else 0.2)


def make_target(directory: Path, *, seed: int = 5, layers: int = 2) -> Path:
    """A Llama of VOCAB ids (the word tokenizer's), hidden 32, no stop token."""
    return make_family_checkpoint(
        directory,
        seed=seed,
        layers=layers,
        vocab_size=VOCAB,
        hidden=32,
        max_position_embeddings=128,
        eos_token_id=None,
        init=sharp_init,
        words=[f"w{i}" for i in range(VOCAB - 2)],
    )


def head_ids() -> list[int]:
    """A reduced vocabulary that is not a prefix of the target's: every id but 3 of them."""
    return [i for i in range(VOCAB) if i not in (1, 9, 17)]


def make_head_dir(target_dir: Path, out: Path, *, seed: int = 0, scale: float = 0.3) -> Path:
    """A random head for the target in `target_dir`, saved to `out` (N(0, scale) weights)."""
    target, _ = load_model(target_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.for_target(target, head_ids()), target.module.model.embed_tokens)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" not in name:
                param.normal_(0, scale)
    save_eagle(head, out)
    return out
