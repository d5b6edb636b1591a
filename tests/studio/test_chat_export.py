"""Chat tab handlers on the real demo model and a LoRA adapter saved like a finished run:
streaming answers, base and fine-tuned side by side in one batch. (The Export tab, whose
source list is checked here too, has its own tests in test_export.py.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import pytest

from kestrel.studio.handlers import chat, export
from kestrel.studio.models import LoadedModel, ModelPool, stream_rows
from tests.jobs.exportkit import finished_run_in
from tests.studio.helpers import error_text

SHARED_HOME = True  # the demo model and the run are built once for this module
GREEDY = dict(system="", temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=6, repetition_penalty=1.0, seed=None)


@pytest.fixture(scope="module")
def finished_run(module_home: Path) -> int:
    """A completed job whose folder holds a LoRA adapter of the demo model with random weights
    (a trained adapter's B is not zero: base and fine-tuned answers must differ)."""
    return finished_run_in(module_home)


@pytest.fixture(scope="module")
def pool() -> ModelPool:
    return ModelPool(capacity=2)


def _last(gen: Iterator[dict]) -> list[dict]:
    outs = list(gen)
    assert len(outs) >= 2  # the placeholder first, then streamed pieces
    return outs


def test_choices_list_finished_runs_and_bases(finished_run: int) -> None:
    values = [v for _, v in chat.target_choices()]
    assert values == [f"run:{finished_run}", "base:demo"]
    assert [v for _, v in export.source_choices()] == [f"run:{finished_run}", "base:demo"]


def test_chat_streams_and_side_by_side_matches_each_model_alone(finished_run: int, pool: ModelPool) -> None:
    target = f"run:{finished_run}"
    outs = _last(chat.respond(pool, "What is 2 + 3?", [], [], "base:demo", None, False, **GREEDY))
    assert outs[0]["message"] == "" and outs[0]["left"][-1]["content"].startswith("Loading")
    base_alone = outs[-1]["left"][-1]["content"]
    assert outs[-1]["left"][0] == {"role": "user", "content": "What is 2 + 3?"} and base_alone
    tuned_alone = _last(chat.respond(pool, "What is 2 + 3?", [], [], target, None, False, **GREEDY))[-1]["left"][-1]["content"]
    both = _last(chat.respond(pool, "What is 2 + 3?", [], [], target, None, True, **GREEDY))[-1]
    assert both["left"][-1]["content"] == base_alone
    assert both["right"][-1]["content"] == tuned_alone
    assert tuned_alone != base_alone  # the adapter is applied to its row only
    # The conversation continues from the panels' histories (Gradio's message dicts).
    history = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]
    follow = _last(chat.respond(pool, "and 3 + 4?", history, [], "base:demo", None, False, **GREEDY))[-1]["left"]
    assert [m["role"] for m in follow] == ["user", "assistant", "user", "assistant"]


def test_stop_ends_an_endless_decode() -> None:
    """The producer thread checks Stop between chunks: a decode that would never end stops."""
    from kestrel.decode import TokenChunk

    class EndlessGenerator:
        stop_ids: list[int] = []

        def chunks(self, prompts: list, max_new: int, sampling: object, adapter: list) -> Iterator[TokenChunk]:
            while True:
                yield TokenChunk([[5]], [None])

    class Tokenizer:
        def decode(self, ids: list[int], **_: object) -> str:
            return "x" * len(ids)

    loaded = LoadedModel("endless", EndlessGenerator(), Tokenizer(), 64)
    rows = stream_rows(loaded, [[1]], [None], 10, None, threading.Event())
    assert next(rows) == ["x"]
    rows.close()
    assert loaded.lock.acquire(timeout=10), "the decode thread did not stop"


def test_closing_the_answer_frees_the_model(finished_run: int, pool: ModelPool) -> None:
    stream = chat.respond(pool, "Count to a hundred.", [], [], "base:demo", None, False, **{**GREEDY, "max_new_tokens": 400})
    next(stream), next(stream)  # the placeholder, then the first piece
    stream.close()  # what Gradio does when Stop is pressed or the tab goes away
    loaded = pool.get("demo")
    assert loaded.lock.acquire(timeout=30), "the decode thread kept the model after Stop"
    loaded.lock.release()
    assert _last(chat.respond(pool, "hi", [], [], "base:demo", None, False, **GREEDY))[-1]["left"][-1]["content"]


def test_chat_errors_are_messages(finished_run: int, pool: ModelPool) -> None:
    cases = [("", "base:demo", False, "Type a message"), ("hi", "base:demo", True, "needs a fine-tuned run"),
             ("hi", "run:999", False, "no job with id 999")]
    for message, target, side, words in cases:
        with pytest.raises(gr.Error) as excinfo:
            list(chat.respond(pool, message, [], [], target, None, side, **GREEDY))
        assert words in error_text(excinfo)
    with pytest.raises(gr.Error) as excinfo:
        list(chat.respond(pool, "hi", [], [], "base:demo", None, False, **{**GREEDY, "top_p": 0.0}))
    assert "top_p" in error_text(excinfo)


def test_describe_target_shows_template_and_panels(finished_run: int) -> None:
    out = chat.describe_target(f"run:{finished_run}", None, True)
    assert "<|im_start|>" in out["template"]
    assert out["right"]["visible"] is True and out["left"]["label"] == "Base: demo"
    single = chat.describe_target("base:demo", None, False)
    assert single["right"]["visible"] is False
