"""Loaded models for the Chat tab, shared by every browser session of one studio process.

A model is heavy and read-only once loaded, so sessions share it instead of each loading its own;
what a session says stays in its own Chatbot state. One `ModelPool` is made by `build_app` and
handed to the chat handlers (no module-level instance). It keeps the `capacity` most recently
used base models; a fine-tuned run is its base model plus an unmerged LoRA adapter, so base and
fine-tuned answers to one prompt come from one batched decode.

A generation runs on a producer thread holding the model's lock (the decode loop is not
re-entrant); the handler reads its pieces from a queue. When the browser presses Stop or goes
away, the handler's generator is closed and sets `stop`, and the producer ends at its next chunk.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MAX_SEQ_LEN = 4096  # chat context cap (prompt + answer) for models that allow more


@dataclass
class LoadedModel:
    """A loaded base model, its decode loop and the adapters attached to it (path -> name)."""

    model: str
    generator: Any
    tokenizer: Any
    max_seq_len: int
    adapters: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ModelPool:
    """LRU of loaded base models; thread-safe."""

    def __init__(self, capacity: int = 2) -> None:
        self.capacity = capacity
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()  # guards the dict and serialises loading

    def get(self, model: str) -> LoadedModel:
        """The loaded `model` (hub id, folder or `demo`), loading it (and evicting) if needed."""
        with self._lock:
            if model in self._models:
                self._models.move_to_end(model)
                return self._models[model]
            while len(self._models) >= self.capacity:
                self._models.popitem(last=False)
            loaded = _load(model)
            self._models[model] = loaded
            return loaded

    def adapter(self, loaded: LoadedModel, path: str, name: str) -> str:
        """Attach the adapter folder `path` to `loaded` once; returns its name for `adapter=`."""
        with loaded.lock:
            if path not in loaded.adapters:
                loaded.generator.load_adapter(path, name)
                loaded.adapters[path] = name
            return loaded.adapters[path]


def _load(model: str) -> LoadedModel:
    from kestrel.decode import Generator
    from kestrel.model.loader import load

    from kestrel.studio.handlers.common import model_config

    config = model_config(model) or {}
    max_len = int(min(config.get("max_position_embeddings") or MAX_SEQ_LEN, MAX_SEQ_LEN))
    hf_model, tokenizer = load(model, max_len, patch=False)
    hf_model.eval()
    return LoadedModel(model, Generator(hf_model, tokenizer, max_seq_len=max_len), tokenizer, max_len)


def stream_rows(loaded: LoadedModel, prompts: list[list[int]], adapters: list[str | None], max_new: int,
                sampling: Any, stop: threading.Event) -> Iterator[list[str]]:
    """Text pieces per row as they decode; ends early once `stop` is set."""
    from kestrel.decode import stream_text

    pieces: queue.Queue[list[str] | BaseException | None] = queue.Queue()

    def produce() -> None:
        try:
            with loaded.lock:
                chunks = loaded.generator.chunks(prompts, max_new, sampling=sampling, adapter=adapters)
                for row_pieces in stream_text(chunks, loaded.tokenizer, loaded.generator.stop_ids):
                    if stop.is_set():
                        break
                    pieces.put(row_pieces)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            pieces.put(exc)
        finally:
            pieces.put(None)

    threading.Thread(target=produce, name="chat-decode", daemon=True).start()
    try:
        while (item := pieces.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
