"""Fixtures for engine tests: tiny models of each family saved as local folders."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.paths import ASSETS
from engine.tiny import tiny_model


@pytest.fixture(scope="session")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "demo")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer):
    """`tiny_model_dir(family)` -> a folder holding a tiny random model and the demo tokenizer."""
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            tiny_model(family, len(demo_tokenizer), seed=0).save_pretrained(folder)
            demo_tokenizer.save_pretrained(folder)
            made[family] = folder
        return made[family]

    return make
