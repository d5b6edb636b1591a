"""The decode loop: one `Generator` per loaded model, for chat, the studio and GRPO rollouts.

    gen = Generator(model, tokenizer)                       # built once per loaded model
    out = gen.generate([ids_a, ids_b], max_new_tokens=256)  # greedy, rows of any lengths
    out = gen.generate(prompts, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=1),
                       adapter=[None, "sft"])               # row 0 base, row 1 fine-tuned
    for piece in gen.stream(ids): print(piece, end="")

How a request runs (gpt-fast's shape):
1. A session holds everything with a fixed address: the static KV cache, the current token,
   the cache column, per-row pad counts, per-row sampling tensors, `done` flags and the output
   buffer. It is kept while batch size and cache length (rounded up to a power of two) repeat.
2. Prefill runs the whole left-padded prompt eagerly (SDPA) and samples the first token.
3. Each decode step - forward one token, sample, write the token, update `done` - reads only
   device tensors. On CUDA it is compiled (torch.compile, kept on this object) and captured
   once per (session, sampling plan, adapter choice) as a CUDA graph; each step is one
   `replay()`. On the CPU the same function runs eagerly.
4. The host never waits for a step. Every `sync_every` steps it queues an async copy of the
   new tokens to pinned memory and an event, and reads the previous chunk's tokens while the
   GPU works on the next. It stops launching once every row has met a stop token (per row:
   EOS or end-of-turn ids) or the token budget; finished rows emit padding on the device.

Rows are left-padded (see `cache.py`). A broadcast `SamplingParams` gives row i the seed
`seed + i` (or a fresh random seed), so GRPO's repeated prompts get different samples.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch

from kestrel.decode.adapters import LoraCall, load_adapter, selection_rows
from kestrel.decode.chat import stop_token_ids
from kestrel.decode.sampling import GREEDY, SamplingParams, SamplingPlan, SamplingState, sample
from kestrel.decode.tracking import GenerationOutput, TokenChunk, Tracker

log = logging.getLogger("kestrel")
MAX_STOPS = 16


@runtime_checkable
class DecodeBackend(Protocol):
    """What the loop needs from a model (`DecodeModel`, or a mock in tests)."""

    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    adapters: list[str]
    quantized: bool

    def new_cache(self, batch: int, length: int) -> Any: ...
    def prefill(self, ids: torch.Tensor, pad: torch.Tensor, cache: Any, lora: LoraCall | None) -> torch.Tensor: ...
    def step(
        self, tok: torch.Tensor, col: torch.Tensor, pad: torch.Tensor, cache: Any, lora: LoraCall | None
    ) -> torch.Tensor: ...
    def sync_lora(self) -> None: ...


class _Session:
    """Device state for one (batch, cache length): the cache and every buffer the step touches."""

    def __init__(self, backend: DecodeBackend, batch: int, length: int, pad_id: int) -> None:
        dev = backend.device
        self.batch, self.length, self.pad_id = batch, length, pad_id
        self.cache = backend.new_cache(batch, length)
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,) token to feed next
        self.col = torch.zeros(1, dtype=torch.long, device=dev)  # cache column it goes to
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # tokens emitted so far
        self.pad = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,) left-pad counts
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.out = torch.full((length, batch), pad_id, dtype=torch.long, device=dev)  # (S, B) step-major
        self.stops = torch.full((MAX_STOPS,), -1, dtype=torch.long, device=dev)
        self.rows = torch.zeros((batch, max(1, len(backend.adapters))), dtype=backend.dtype, device=dev)
        self.sampling = SamplingState(batch, backend.vocab_size, dev)
        self.graphs: dict[Any, Callable[[], None]] = {}
        # Pinned, step-major: a chunk of steps is one contiguous async copy.
        self.host = torch.empty((length, batch), dtype=torch.long, pin_memory=True) if dev.type == "cuda" else None

    def reset(self, col: int) -> None:
        self.col.fill_(col)
        self.step.zero_()
        self.done.zero_()
        self.out.fill_(self.pad_id)
        self.sampling.seen.zero_()

    def readback(self, lo: int, hi: int) -> Callable[[], list[list[int]]]:
        """Queue a copy of steps [lo, hi); the returned callable waits for it -> (hi-lo, B) ids."""
        if self.host is None:
            rows = self.out[lo:hi].tolist()
            return lambda: rows
        self.host[lo:hi].copy_(self.out[lo:hi], non_blocking=True)
        event = torch.cuda.Event()
        event.record()

        def wait() -> list[list[int]]:
            event.synchronize()
            return self.host[lo:hi].tolist()

        return wait


@dataclass
class _Request:
    ids: torch.Tensor  # (B, T) left-padded prompt ids on the device
    prompts: list[list[int]]
    params: list[SamplingParams]
    plan: SamplingPlan
    lora: LoraCall | None
    lora_key: Any
    stops: list[int]
    max_new: int


def _cache_length(needed: int, max_seq_len: int, cuda: bool) -> int:
    """Round up to a power of two (at least 256 on CUDA, 64 on CPU) so sessions get reused."""
    length = max(256 if cuda else 64, 1 << (needed - 1).bit_length())
    return min(length, max_seq_len)


class Generator:
    """Fast generation on one loaded model (see the module docstring).

    `model`: a Hugging Face causal LM of a registered family (a PeftModel too), or any
    `DecodeBackend`. `stop_ids` default to the tokenizer's EOS and end-of-turn ids.
    `compile` / `cuda_graphs` default to on for CUDA (compile off for quantized bases whose
    modules run in the step: their ops run eagerly inside the graph; NF4 bases read by
    `kestrel.kernels.decode.nf4_gemv` compile), off on the CPU. `fuse`: q/k/v and gate/up as one product
    each, their weights re-pointed into one buffer (no copy; see `fused.py`): None = where safe
    (frozen base or eval mode), False = never. `close()` undoes it.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        max_seq_len: int | None = None,
        stop_ids: Sequence[int] | None = None,
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        sync_every: int = 16,
        fuse: bool | None = None,
    ) -> None:
        self.model, self.tokenizer, self.sync_every, self.fuse = model, tokenizer, sync_every, fuse
        self.max_seq_len = max_seq_len or _default_max_seq_len(model)
        is_backend = isinstance(model, DecodeBackend)
        self.backend: DecodeBackend = model if is_backend else _decode_model(model, self.max_seq_len, fuse)
        if stop_ids is None:
            stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None)) if tokenizer else []
        self.stop_ids = list(stop_ids)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_id = int(pad) if pad is not None else (self.stop_ids[0] if self.stop_ids else 0)
        cuda = self.backend.device.type == "cuda"
        self.cuda_graphs = (cuda if cuda_graphs is None else (cuda_graphs and cuda)) and getattr(
            self.backend, "graphable", True)
        compilable = getattr(self.backend, "compilable", not self.backend.quantized)
        self.compile = (cuda and compilable) if compile is None else compile
        # Compiled functions live on objects (not module globals): the backend's layer step,
        # and the sampling/bookkeeping step here.
        self._emit_fn = self._emit
        if self.compile:
            self._compile()
        self._session: _Session | None = None
        self._busy = False
        self.first_token_s = 0.0  # of the latest request

    # --- public API ----------------------------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        return list(self.backend.adapters)

    def load_adapter(self, path: str, name: str = "default") -> None:
        """Attach a PEFT adapter folder unmerged; afterwards `adapter=name` selects it."""
        self.model = load_adapter(self.model, path, name)
        self.rebuild()

    def release(self) -> None:
        """Free the KV cache and captured graphs (e.g. before a training step). Compiled code is
        kept, so the next request only re-allocates and re-captures (well under a second)."""
        if self._busy:
            raise RuntimeError("cannot release the session while a request is running")
        self._session = None

    def close(self) -> None:
        """`release()`, and give the model's projections separate storage back (undo the fused
        buffers: e.g. before full fine-tuning, or saving a raw state dict with safetensors). The
        generator stays usable: its next request fuses again where allowed."""
        self.release()
        unfuse = getattr(self.backend, "unfuse", None)
        if unfuse is not None:
            unfuse()

    def rebuild(self) -> None:
        """Re-read the model after LoRA layers were added or removed (not after training steps:
        adapter weights are re-read on every request). Recompiles on CUDA: use `release()`
        merely to free memory."""
        self.close()  # the old backend's buffers go before the new one allocates its own
        self.backend = _decode_model(self.model, self.max_seq_len, self.fuse)
        self._session = None
        if self.compile:
            self._compile()

    def _compile(self) -> None:
        if hasattr(self.backend, "compile"):
            self.backend.compile()
        self._emit_fn = torch.compile(self._emit, fullgraph=True)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 256,
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        adapter: str | None | Sequence[str | None] = None,
        stop_ids: Sequence[int] | None = None,
    ) -> GenerationOutput:
        """Generate for every prompt (lists of token ids); returns each row's new tokens."""
        start = time.perf_counter()
        tracker = None
        for tracker in self._run(prompts, max_new_tokens, sampling, adapter, stop_ids):  # noqa: B007 - the last one
            pass
        assert tracker is not None
        return GenerationOutput(tracker.tokens, list(tracker.reasons), self.first_token_s, time.perf_counter() - start)

    def chunks(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 256,
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        adapter: str | None | Sequence[str | None] = None,
        stop_ids: Sequence[int] | None = None,
    ) -> Iterator[TokenChunk]:
        """Like `generate`, but yields each row's new tokens as they reach the host."""
        for tracker in self._run(prompts, max_new_tokens, sampling, adapter, stop_ids):
            yield tracker.last

    def stream(self, prompt: Sequence[int], max_new_tokens: int = 256, **kwargs: Any) -> Iterator[str]:
        """Text pieces of one completion; never splits a multi-byte character."""
        from kestrel.decode.stream import stream_text

        if self.tokenizer is None:
            raise ValueError("stream() needs the Generator to have a tokenizer")
        stops = kwargs.get("stop_ids") or self.stop_ids
        for pieces in stream_text(self.chunks([prompt], max_new_tokens, **kwargs), self.tokenizer, stops):
            if pieces[0]:
                yield pieces[0]

    # --- the loop ------------------------------------------------------------------------------

    def _run(self, prompts, max_new_tokens, sampling, adapter, stop_ids) -> Iterator[Tracker]:
        """One request at a time (the session's buffers are shared): see `_decode`."""
        if self._busy:
            raise RuntimeError("this Generator is already running a request; serialize calls (one per model)")
        self._busy = True
        try:
            yield from self._decode(prompts, max_new_tokens, sampling, adapter, stop_ids)
        finally:
            self._busy = False

    def _decode(self, prompts, max_new_tokens, sampling, adapter, stop_ids) -> Iterator[Tracker]:
        """Prefill, then pipelined decode; yields the tracker after each chunk reaches the host.

        Work runs under no_grad in short blocks, never across a `yield`, so the caller's grad
        mode is untouched between chunks.
        """
        with torch.no_grad(), _compile_limits():
            req, s, runner = self._prepare(prompts, max_new_tokens, sampling, adapter, stop_ids)
            start = time.perf_counter()
            logits = self.backend.prefill(req.ids, s.pad, s.cache, req.lora)
            self._emit(s, logits, req.plan)
            first = s.readback(0, 1)()
        self.first_token_s = time.perf_counter() - start
        tracker = Tracker(s.batch, req.stops, req.max_new)
        tracker.add(first)
        yield tracker
        pending: list[Callable[[], list[list[int]]]] = []
        launched = 1  # tokens queued so far (the first came from prefill)
        while not tracker.finished:
            # Keep two chunks queued: the GPU runs one while the host reads the other.
            while len(pending) < 2 and launched < req.max_new:
                k = min(self.sync_every, req.max_new - launched)
                with torch.no_grad(), _compile_limits():
                    for _ in range(k):
                        runner()
                    pending.append(s.readback(launched, launched + k))
                launched += k
            if not pending:
                break
            tracker.add(pending.pop(0)())
            yield tracker

    def _prepare(
        self, prompts: Any, max_new_tokens: int, sampling: Any, adapter: Any, stop_ids: Any
    ) -> tuple[_Request, _Session, Callable[[], None]]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        prompts = [[int(t) for t in p] for p in prompts]
        batch, longest = len(prompts), max(len(p) for p in prompts)
        if longest >= self.max_seq_len:
            raise ValueError(f"prompt of {longest} tokens does not fit max_seq_len={self.max_seq_len}")
        max_new = max(1, min(max_new_tokens, self.max_seq_len - longest))
        length = _cache_length(longest + max_new, self.max_seq_len, self.backend.device.type == "cuda")
        refresh = getattr(self.backend, "refresh", None)  # fused weights re-bound if replaced
        if refresh is not None and refresh():
            self._session = None  # captured graphs read the old buffers
        s = self._session_for(batch, length)
        req = self._request(s, prompts, max_new, sampling, adapter, stop_ids)
        runner = self._runner(s, req)
        self._load(s, req, longest)
        return req, s, runner

    def _request(
        self, s: _Session, prompts: list[list[int]], max_new: int, sampling: Any, adapter: Any, stop_ids: Any
    ) -> _Request:
        batch, longest, dev = len(prompts), max(len(p) for p in prompts), self.backend.device
        params = _row_params(sampling, batch)
        stops = list(self.stop_ids if stop_ids is None else stop_ids)
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop ids, got {len(stops)}")
        choice = [adapter] * batch if adapter is None or isinstance(adapter, str) else list(adapter)
        if len(choice) != batch:
            raise ValueError(f"{len(choice)} adapter choices for {batch} prompts")
        rows = selection_rows(self.backend.adapters, choice)  # validates the names
        if all(c is None for c in choice):
            lora, key = None, None
        elif len(set(choice)) == 1:
            index = self.backend.adapters.index(choice[0])
            lora, key = LoraCall(index), ("uniform", index)
        else:
            lora, key = LoraCall(None, s.rows), "mixed"
        s.rows.copy_(rows.to(s.rows.dtype), non_blocking=True)
        ids = torch.full((batch, longest), self.pad_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, longest - len(p) :] = torch.tensor(p)
        plan = SamplingPlan.of(params, self.backend.vocab_size)
        return _Request(ids.to(dev), prompts, params, plan, lora, key, stops, max_new)

    def _load(self, s: _Session, req: _Request, longest: int) -> None:
        """Reset the session for this request and copy its per-row data in."""
        s.reset(longest)
        s.pad.copy_(torch.tensor([longest - len(p) for p in req.prompts]), non_blocking=True)
        stops = torch.full((MAX_STOPS,), -1, dtype=torch.long)
        stops[: len(req.stops)] = torch.tensor(req.stops, dtype=torch.long)
        s.stops.copy_(stops, non_blocking=True)
        s.sampling.load(req.params)
        if req.plan.penalty:
            seen = torch.zeros_like(s.sampling.seen, device="cpu")
            for b, p in enumerate(req.prompts):
                seen[b, p] = True
            s.sampling.seen.copy_(seen, non_blocking=True)
        if req.lora is not None:
            self.backend.sync_lora()

    def _session_for(self, batch: int, length: int) -> _Session:
        s = self._session
        if s is None or s.batch != batch or s.length != length:
            self._session = None  # free the old cache and graphs before allocating new ones
            s = self._session = _Session(self.backend, batch, length, self.pad_id)
        return s

    # --- the step: compiled and graph-captured on CUDA -------------------------------------------

    def _emit(self, s: _Session, logits: torch.Tensor, plan: SamplingPlan) -> None:
        """logits (B, V) -> sample, write the step's tokens, update `done`. Device tensors only."""
        nxt = sample(logits, plan, s.sampling, s.step)  # (B,)
        nxt = torch.where(s.done, s.pad_id, nxt)  # finished rows emit padding
        s.out[s.step] = nxt[None]
        s.done.logical_or_((nxt[:, None] == s.stops[None]).any(-1))
        if plan.penalty:
            s.sampling.seen.scatter_(1, nxt[:, None], True)
        s.tok.copy_(nxt)
        s.step.add_(1)

    def _step(self, s: _Session, plan: SamplingPlan, lora: LoraCall | None) -> None:
        logits = self.backend.step(s.tok, s.col, s.pad, s.cache, lora)  # (B, V)
        s.col.add_(1)
        self._emit_fn(s, logits, plan)

    def _runner(self, s: _Session, req: _Request) -> Callable[[], None]:
        """The callable that runs one decode step for this request's shape of work."""
        key = (req.plan, req.lora_key)
        if key not in s.graphs:
            step = functools.partial(self._step, s, req.plan, req.lora)
            s.graphs[key] = self._capture(s, step, req) if self.cuda_graphs else step
        return s.graphs[key]

    def _capture(self, s: _Session, step: Callable[[], None], req: _Request) -> Callable[[], None]:
        """Capture one decode step as a CUDA graph; on failure retry uncompiled, then run eagerly.

        The warm-up steps write real cache columns and bump counters; `_load` resets all of it
        before the request runs.
        """
        s.reset(0)
        try:
            return _graph(step)
        except RuntimeError as exc:  # compile or capture failed: correctness first
            if not self.compile:
                log.warning("decode step not captured as a CUDA graph (%s); running it eagerly", exc)
                return step
            log.warning("compiled decode step failed (%s); capturing the eager step instead", exc)
        self.compile = False
        self._emit_fn = self._emit
        if hasattr(self.backend, "compile"):
            self.backend.compile(False)
        return self._capture(s, step, req)


def _compile_limits() -> Any:
    """Let the compiled layer recompile per variant (window, adapter mode, shapes) past the default 8."""
    cfg = torch._dynamo.config
    return cfg.patch(**{"recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit": 64})


def _graph(step: Callable[[], None]) -> Callable[[], None]:
    """Warm `step` up on a side stream (this is where it compiles), then capture it once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), _compile_limits():
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _row_params(sampling: SamplingParams | Sequence[SamplingParams], batch: int) -> list[SamplingParams]:
    if isinstance(sampling, SamplingParams):
        seeded = sampling.seed is not None
        return [dataclasses.replace(sampling, seed=sampling.seed + i if seeded else None) for i in range(batch)]
    params = list(sampling)
    if len(params) != batch:
        raise ValueError(f"{len(params)} sampling settings for {batch} prompts")
    return params


def _default_max_seq_len(model: Any) -> int:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    explicit = getattr(model, "kestrel_max_seq_length", None) or getattr(inner, "kestrel_max_seq_length", None)
    if explicit:
        return int(explicit)
    return int(min(getattr(getattr(inner, "config", None), "max_position_embeddings", 4096) or 4096, 8192))


def _decode_model(model: Any, max_seq_len: int, fuse: bool | None) -> DecodeBackend:
    from kestrel.decode.hf_backend import decode_backend

    return decode_backend(model, max_seq_len, fuse)
