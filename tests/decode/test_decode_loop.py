"""The decode loop, sampling and streaming without a real model (nanochat-style mock model).

The mock's next token is a fixed function of each row's whole history (read back from its
"KV cache", which stores the tokens fed at each column), so any slip in padding, columns, the
token fed back, per-row stopping or chunked read-back changes the output.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kestrel.decode.adapters import AdapterError
from kestrel.decode.chat import encode_chat, stop_token_ids
from kestrel.decode.generate import Generator, TokenChunk
from kestrel.decode.sampling import SamplingParams, SamplingPlan, SamplingState, filter_logits, sample, uniform_noise
from kestrel.decode.stream import TextStream, stream_text
from kestrel.paths import ASSETS

V = 97


def _next(history: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(history)) + 3 * len(history)) % V


class MockBackend:
    """A DecodeBackend whose cache holds the tokens fed at each column."""

    vocab_size, device, dtype, adapters, quantized = V, torch.device("cpu"), torch.float32, [], False

    def __init__(self) -> None:
        self.steps = 0

    def new_cache(self, batch: int, length: int) -> torch.Tensor:
        return torch.full((batch, length), -1, dtype=torch.long)

    def _logits(self, cache: torch.Tensor, pad: torch.Tensor, upto: int) -> torch.Tensor:
        targets = [_next(cache[b, int(pad[b]) : upto + 1].tolist()) for b in range(cache.shape[0])]
        return -(torch.arange(V)[None] - torch.tensor(targets)[:, None]).abs().float()  # argmax = target

    def prefill(self, ids, pad, cache, lora):
        cache[:, : ids.shape[1]] = ids
        return self._logits(cache, pad, ids.shape[1] - 1)

    def step(self, tok, col, pad, cache, lora):
        self.steps += 1
        cache[:, col] = tok[:, None]
        return self._logits(cache, pad, int(col))

    def sync_lora(self) -> None:
        pass


def _reference(prompt: list[int], n: int, stops: set[int]) -> tuple[list[int], str]:
    history, out = list(prompt), []
    for _ in range(n):
        tok = _next(history)
        history.append(tok)
        out.append(tok)
        if tok in stops:
            return out, "stop"
    return out, "length"


PROMPTS = [[5, 1, 7], [2] * 11, [40, 41, 42, 43, 44, 45]]


@pytest.mark.parametrize("sync_every", [1, 3, 16])
def test_rows_stop_on_their_own_and_chunks_reassemble(sync_every: int) -> None:
    free = [_reference(p, 40, set())[0] for p in PROMPTS]
    stops = [free[0][4], free[2][17]]  # row 0 stops early, row 2 later, row 1 maybe never
    gen = Generator(MockBackend(), max_seq_len=128, stop_ids=stops, sync_every=sync_every)
    out = gen.generate(PROMPTS, max_new_tokens=40)
    expected = [_reference(p, 40, set(stops)) for p in PROMPTS]
    assert out.tokens == [e[0] for e in expected]
    assert out.finish_reasons == [e[1] for e in expected]
    pieces = [[] for _ in PROMPTS]
    for chunk in gen.chunks(PROMPTS, max_new_tokens=40):
        for b, toks in enumerate(chunk.tokens):
            pieces[b] += toks
    assert pieces == out.tokens


def test_loop_stops_launching_once_every_row_is_done() -> None:
    backend = MockBackend()
    first = _reference(PROMPTS[1], 1, set())[0][0]
    gen = Generator(backend, max_seq_len=512, stop_ids=[first], sync_every=4)
    out = gen.generate([PROMPTS[1]], max_new_tokens=300)
    assert out.tokens == [[first]] and out.finish_reasons == ["stop"]
    assert backend.steps == 0  # stopped by the prefill's token: no decode step ran
    stop = _reference(PROMPTS[0], 30, set())[0][9]
    backend.steps = 0
    Generator(backend, max_seq_len=512, stop_ids=[stop], sync_every=4).generate([PROMPTS[0]], max_new_tokens=300)
    assert backend.steps <= 9 + 2 * 4  # at most the two chunks in flight past the stop


def test_budget_is_clamped_to_the_context_and_bad_input_is_refused() -> None:
    gen = Generator(MockBackend(), max_seq_len=16, stop_ids=[])
    out = gen.generate([list(range(1, 13))], max_new_tokens=100)
    assert len(out.tokens[0]) == 4 and out.finish_reasons == ["length"]
    with pytest.raises(ValueError):
        gen.generate([[]])
    with pytest.raises(ValueError):
        gen.generate([list(range(20))])
    with pytest.raises(AdapterError):
        gen.generate([[1, 2]], adapter="nope")


# --- sampling ------------------------------------------------------------------------------------


def _state(params: list[SamplingParams], vocab: int) -> SamplingState:
    st = SamplingState(len(params), vocab, torch.device("cpu"))
    st.load(params)
    return st


def _hf_filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scores = TemperatureLogitsWarper(p.temperature)(None, logits[None].clone())
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    return scores[0]


def test_filters_keep_the_same_tokens_as_hf_warpers() -> None:
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.5, top_k=25, top_p=0.6),
        SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(temperature=1.2, top_k=30, top_p=0.95, min_p=0.05),
        SamplingParams(temperature=1.0),
    ]
    logits = torch.randn(len(params), 200) * 3
    plan = SamplingPlan.of(params, 200)
    st = _state(params, 200)
    scaled = logits / st.temperature[:, None]
    ours = filter_logits(scaled, plan, st)
    for b, p in enumerate(params):
        ref = _hf_filtered(logits[b], p)
        assert torch.equal(torch.isinf(ours[b]), torch.isinf(ref)), p
        assert 0 < int(torch.isfinite(ours[b]).sum()) <= (p.top_k or 200)
    only_k = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0)]
    kept = filter_logits(logits[:2], SamplingPlan.of(only_k, 200), _state(only_k, 200)).isfinite().sum(-1)
    assert kept.tolist() == [5, 200]


def test_samples_follow_the_distribution() -> None:
    rows, vocab = 4096, 6
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]).expand(rows, vocab)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(rows)]
    tokens = sample(logits, SamplingPlan.of(params, vocab), _state(params, vocab), torch.tensor([3]))
    freq = torch.bincount(tokens, minlength=vocab).float() / rows
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.03, rtol=0)  # ~4 sigma
    top2 = [SamplingParams(temperature=1.0, top_k=2, seed=i) for i in range(rows)]
    tokens = sample(logits, SamplingPlan.of(top2, vocab), _state(top2, vocab), torch.tensor([3]))
    assert set(tokens.tolist()) == {0, 1}


def test_noise_is_a_pure_function_of_seed_step_and_token() -> None:
    seed, step = torch.tensor([1, 2, 1]), torch.tensor([5])
    u = uniform_noise(seed, step, 1000)
    assert torch.equal(u, uniform_noise(seed, step, 1000))
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert not torch.equal(u, uniform_noise(seed, torch.tensor([6]), 1000))
    assert float(u.min()) > 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02


def test_greedy_rows_take_the_argmax_in_a_sampling_batch() -> None:
    logits = torch.randn(3, 50)
    params = [SamplingParams(), SamplingParams(temperature=5.0, seed=1), SamplingParams()]
    tokens = sample(logits, SamplingPlan.of(params, 50), _state(params, 50), torch.tensor([0]))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


# --- streaming and chat helpers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "demo")


TEXT = "Hi 世界! Ünïcødé 🎉🚀 naïve café — ok 😀 end"


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stream_reassembles_multibyte_text_exactly(demo_tokenizer, step: int) -> None:
    ids = demo_tokenizer.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in demo_tokenizer.decode([i]) for i in ids)  # characters really are split
    stream = TextStream(demo_tokenizer)
    pieces = [stream.push(ids[i : i + step]) for i in range(0, len(ids), step)] + [stream.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT == demo_tokenizer.decode(ids)


def test_stop_ids_come_from_the_template_and_stream_leaves_them_out(demo_tokenizer) -> None:
    im_end = demo_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in stop_token_ids(demo_tokenizer)
    ids = demo_tokenizer.encode("done 🎉", add_special_tokens=False)
    chunks = [TokenChunk([ids[:2]], [None]), TokenChunk([ids[2:] + [im_end]], ["stop"])]
    assert "".join(p[0] for p in stream_text(chunks, demo_tokenizer, [im_end], skip_special_tokens=False)) == "done 🎉"
    prompt = encode_chat(demo_tokenizer, [{"role": "user", "content": "hi"}])
    assert demo_tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")


def test_generator_stream_matches_generate(demo_tokenizer) -> None:
    backend = MockBackend()
    backend.vocab_size = demo_tokenizer.vocab_size  # ids the demo tokenizer can decode
    gen = Generator(backend, demo_tokenizer, max_seq_len=256, stop_ids=[])
    prompt = demo_tokenizer.encode("🎉 héllo", add_special_tokens=False)
    full = gen.generate([prompt], max_new_tokens=60).tokens[0]
    text = "".join(gen.stream(prompt, max_new_tokens=60))
    assert text == demo_tokenizer.decode(full, skip_special_tokens=True)


def test_one_request_at_a_time() -> None:
    gen = Generator(MockBackend(), max_seq_len=64, stop_ids=[])
    running = gen.chunks([[1, 2]], max_new_tokens=20)
    next(running)
    with pytest.raises(RuntimeError):
        gen.generate([[3]])
    running.close()  # an abandoned stream frees the generator
    assert gen.generate([[1, 2]], max_new_tokens=5).finish_reasons == ["length"]


def test_release_frees_the_session_and_the_next_request_rebuilds_it() -> None:
    gen = Generator(MockBackend(), max_seq_len=64, stop_ids=[])
    first = gen.generate(PROMPTS, max_new_tokens=10).tokens
    assert gen._session is not None
    gen.release()
    assert gen._session is None
    assert gen.generate(PROMPTS, max_new_tokens=10).tokens == first


def test_two_stage_argmax_matches_argmax() -> None:
    """argmax_last = argmax(-1) on a 128K vocabulary: ties go to the first index, also across
    chunk borders; a maximum in the last, partial chunk; rows of -inf but one entry."""
    from kestrel.decode.sampling import argmax_last

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 128_257, generator=gen)
    x[1, 70_000] = x[1, 3] = 99.0  # a tie: the first index wins
    x[2, 128_256] = 99.0  # in the padded last chunk
    x[3] = float("-inf")
    x[3, 77] = 0.0
    x[4, 2004] = x[4, 2005] = 50.0  # a tie on a chunk border (chunk width 2005)
    assert argmax_last(x).tolist() == x.argmax(-1).tolist() == [int(x[0].argmax()), 3, 128_256, 77, 2004]
    small = torch.randn(3, 100, generator=gen)
    assert argmax_last(small).tolist() == small.argmax(-1).tolist()
