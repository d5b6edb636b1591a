"""Loaded models for the Chat tab, shared by every browser session of one studio process.

A model is heavy and read-only once loaded, so sessions share it instead of each loading its own;
what a session says stays in its own Chatbot state. One `ModelPool` is made by `build_app` and
handed to the chat handlers (no module-level instance). It keeps the `capacity` most recently
used base models; a fine-tuned run is its base model plus an unmerged LoRA adapter, so base and
fine-tuned answers to one prompt come from one batched decode. A full fine-tune and its base are
two loaded models; `pair` puts both behind one decode loop (`kestrel.decode.pair.ModelRows`), so
their answers also come from one batched decode.

A generation runs on a producer thread holding the model's lock (the decode loop is not
re-entrant); the handler reads its pieces from a queue. When the browser presses Stop or goes
away, the handler's generator is closed and sets `stop`, and the producer ends at its next chunk.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
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
    lock: Any = field(default_factory=threading.Lock)


class AllLocks:
    """The locks of several loaded models as one lock, always taken in the same order (no deadlock
    between two pairs that share a model)."""

    def __init__(self, models: list[LoadedModel]) -> None:
        self.locks = [m.lock for m in sorted(models, key=lambda m: m.model)]
        self._stack: ExitStack | None = None

    def __enter__(self) -> AllLocks:
        with ExitStack() as stack:
            for lock in self.locks:
                stack.enter_context(lock)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


class ModelPool:
    """LRU of loaded base models; thread-safe."""

    def __init__(self, capacity: int = 2) -> None:
        self.capacity = capacity
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._pairs: dict[tuple[str, ...], LoadedModel] = {}
        self._lock = threading.Lock()  # guards the dicts and serialises loading

    def get(self, model: str) -> LoadedModel:
        """The loaded `model` (hub id, folder or `demo`), loading it (and evicting) if needed."""
        with self._lock:
            if model in self._models:
                self._models.move_to_end(model)
                return self._models[model]
            while len(self._models) >= self.capacity:
                gone, _ = self._models.popitem(last=False)
                self._pairs = {k: v for k, v in self._pairs.items() if gone not in k}
            loaded = _load(model)
            self._models[model] = loaded
            return loaded

    def pair(self, models: list[LoadedModel]) -> LoadedModel | None:
        """One decode loop over `models` (row group g = model g), or None when their tokenizers
        differ (their answers cannot share one sampler and stop list) or their decode paths
        cannot share a batch. Its lock takes every member's lock."""
        from kestrel.decode import Generator
        from kestrel.decode.pair import ModelRows

        backends = [m.generator.backend for m in models]
        key = tuple(m.model for m in models)
        with self._lock:
            found = self._pairs.get(key)
            if found is not None and found.generator.backend.members == backends:
                return found
            vocab = models[0].tokenizer.get_vocab()
            if any(m.tokenizer.get_vocab() != vocab for m in models[1:]):
                return None
            try:
                rows = ModelRows(backends)
            except ValueError:
                return None
            stops = sorted({s for m in models for s in m.generator.stop_ids})
            max_len = min(m.max_seq_len for m in models)
            generator = Generator(rows, models[-1].tokenizer, max_seq_len=max_len, stop_ids=stops)
            found = LoadedModel("+".join(key), generator, models[-1].tokenizer, max_len, lock=AllLocks(models))
            self._pairs[key] = found
            return found

    def adapter(self, loaded: LoadedModel, path: str) -> str:
        """Attach the adapter folder `path` to `loaded` once; returns its name for `adapter=`."""
        with loaded.lock:
            if path not in loaded.adapters:
                name = f"adapter-{len(loaded.adapters)}"
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


class RowSpeed:
    """New tokens of each row (stop tokens left out) and the seconds from the request to the
    row's end (prompt processing included): the tokens/s the Chat tab shows under each answer."""

    def __init__(self, rows: int, stops: Iterable[int]) -> None:
        self.tokens = [0] * rows
        self.ended: list[float | None] = [None] * rows
        self.stops = set(stops)
        self.start = time.perf_counter()

    def count(self, chunks: Iterable[Any]) -> Iterator[Any]:
        """Pass `chunks` (TokenChunk) through, counting them."""
        for chunk in chunks:
            now = time.perf_counter()
            for b, toks in enumerate(chunk.tokens):
                self.tokens[b] += sum(t not in self.stops for t in toks)
                if chunk.finished[b] and self.ended[b] is None:
                    self.ended[b] = now
            yield chunk

    def seconds(self, row: int) -> float:
        return (self.ended[row] or time.perf_counter()) - self.start

    def rate(self, row: int) -> float:
        return self.tokens[row] / max(self.seconds(row), 1e-9)


def stream_rows(loaded: LoadedModel, prompts: list[list[int]], adapters: list[str | None], max_new: int,
                sampling: Any, stop: threading.Event, speed: RowSpeed | None = None) -> Iterator[list[str]]:
    """Text pieces per row as they decode; ends early once `stop` is set. `speed`, when given,
    counts each row's tokens and time."""
    from kestrel.decode import stream_text

    pieces: queue.Queue[list[str] | BaseException | None] = queue.Queue()

    def produce() -> None:
        try:
            with loaded.lock:
                decode = loaded.generator.chunks(prompts, max_new, sampling=sampling, adapter=adapters)
                if speed is not None:
                    speed.start = time.perf_counter()
                chunks = speed.count(decode) if speed is not None else decode
                texts = stream_text(chunks, loaded.tokenizer, loaded.generator.stop_ids)
                try:
                    for row_pieces in texts:
                        if stop.is_set():
                            break
                        pieces.put(row_pieces)
                finally:  # ends the decode (the generator is free again) before the lock goes
                    texts.close()
                    decode.close()
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
