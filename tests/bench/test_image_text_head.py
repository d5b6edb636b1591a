"""bench/image_text_head.py's choice of image-text class for a matrix shape's language model."""

from __future__ import annotations

import pytest

from bench import image_text_head
from bench.model_shapes import MODELS


def test_each_image_text_family_of_the_matrix_gets_its_class() -> None:
    kinds = {name: image_text_head.image_text_type(MODELS[name]["model_type"])
             for name in ("gemma3-4b", "qwen3.5-9b", "mistral-7b")}
    assert kinds == {"gemma3-4b": "gemma3", "qwen3.5-9b": "qwen3_5", "mistral-7b": "mistral3"}


def test_a_language_model_no_image_text_class_holds_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="no image-text class has a qwen2 language model"):
        image_text_head.image_text_type("qwen2")
