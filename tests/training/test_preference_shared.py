"""A pair scored as one sample [prompt, chosen, rejected], the prompt computed once
(`rows.shared_answer_rows`, preference.share_prompt), gives the log-probs, DPO loss and LoRA
gradients of chosen and rejected scored as separate sequences: fp32 on a CPU through the varlen
reference (`reference_varlen_attn`), prompts and answers of different lengths in one batch, and a
pair whose answers share their first tokens. A layout whose rejected answer sees the chosen one
fails the same check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kestrel.config import config_from_dict
from kestrel.data.preference_tokens import PreferenceSample
from kestrel.errors import ConfigError
from kestrel.model import attention as attn
from kestrel.model.patching import PatchFlags, patch_model, prompt_sharing_refusal
from kestrel.training.preference import rows as R
from kestrel.training.preference import score
from kestrel.training.preference.reference import adapter_layers
from kestrel.training.preference import trainer
from kestrel.training.preference.trainer import share_prompt
from kestrel.training.run import run
from kestrel.training.preference.rows import answer_logprobs, shared_answer_rows
from tests.support.tiny import tiny_model
from tests.training.test_preference_rows import _grads, _model
from tests.training.test_preference_train import _config, _metrics, _subset

# (prompt, chosen, rejected) lengths; the last pair's answers share their first three tokens
SHAPES = [(5, 7, 3), (9, 2, 6), (2, 4, 4), (6, 5, 8)]
SHARED_START = 3


def _samples(vocab: int) -> list[PreferenceSample]:
    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()  # noqa: E731
    out = [PreferenceSample(ids(p), [ids(c), ids(r)]) for p, c, r in SHAPES]
    last = out[-1].answers
    last[1][:SHARED_START] = last[0][:SHARED_START]
    return out


def _run(model, samples, share: bool, device: str = "cpu") -> dict:
    """One DPO micro-batch through `score.micro_loss` (reference pass with the adapter off, then
    the policy with gradients): the (R, L) policy log-probs, the loss and the LoRA gradients."""
    cfg = config_from_dict({"model": "demo", "method": "dpo", "preference": {"beta": 0.1, "loss_type": "sigmoid"}})
    s = SimpleNamespace(config=cfg, model=model, pad_id=0, device=torch.device(device), flat=True, share_prompt=share,
                        adapter_layers=adapter_layers(model))
    stats = score.StepStats(torch.zeros(()))
    loss = score.micro_loss(s, score.RowSet(samples), list(range(len(samples))), stats)
    loss.backward()
    with torch.no_grad():
        logp = answer_logprobs(model, score.scored_rows(s, samples))
    return {"loss": loss.detach(), "logp": logp, "chosen": stats.logps_chosen[0], "rejected": stats.logps_rejected[0],
            "grads": _grads(model)}


def _assert_same(shared: dict, separate: dict) -> None:
    torch.testing.assert_close(shared["logp"], separate["logp"], rtol=1e-5, atol=1e-5)
    for key in ("chosen", "rejected", "loss"):
        torch.testing.assert_close(shared[key], separate[key], rtol=1e-5, atol=1e-5, msg=key)
    assert shared["grads"].keys() == separate["grads"].keys() and shared["grads"]
    for name, grad in separate["grads"].items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(shared["grads"][name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prompt_scored_once_equals_separate_sequences(tiny_model_dir, family: str, one_thread) -> None:
    model, tok = _model(str(tiny_model_dir(family)), lora=True, patch=PatchFlags(varlen="reference"))
    assert prompt_sharing_refusal(model) is None
    samples = _samples(len(tok))
    separate = _run(model, samples, share=False)
    shared = _run(model, samples, share=True)
    _assert_same(shared, separate)
    lengths = [c for _, c, _ in SHAPES] + [r for _, _, r in SHAPES]
    assert all(separate["logp"][i, n:].abs().max() == 0 for i, n in enumerate(lengths) if n < max(lengths))
    rows = shared_answer_rows([(x.prompt, x.answers) for x in samples], 0, torch.device("cpu"))
    assert rows.used == sum(p + c + r for p, c, r in SHAPES)  # each prompt once
    assert rows.real_tokens == sum(2 * p + c + r for p, c, r in SHAPES)  # counted as the separate rows count it


def _leaky_fork_layout(groups, width, key_width, device):
    """The rejected answer sees the chosen one: each group one plain causal sample."""
    lengths = [p + sum(b) for p, b in groups]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()] + ([width] if width > sum(lengths) else []))
    samples = attn.Samples(cu.to(torch.int32), width)
    return attn.ForkedSamples(samples, attn.KeyLayout(torch.arange(width), samples))


def test_a_rejected_answer_that_sees_the_chosen_one_fails_the_check(tiny_model_dir, monkeypatch, one_thread) -> None:
    model, tok = _model(str(tiny_model_dir("llama")), lora=True, patch=PatchFlags(varlen="reference"))
    samples = _samples(len(tok))
    separate = _run(model, samples, share=False)
    monkeypatch.setattr(R, "fork_layout", _leaky_fork_layout)
    leaky = _run(model, samples, share=True)
    torch.testing.assert_close(leaky["chosen"], separate["chosen"], rtol=1e-5, atol=1e-5)  # chosen is unaffected
    with pytest.raises(AssertionError):
        _assert_same(leaky, separate)


def test_shared_rows_layout() -> None:
    """Positions, predicting columns and the fork of two groups; widths rounded with a padding tail."""
    groups = [([1, 2, 3], [[4, 5], [6, 7, 8]]), ([9, 10], [[11], [12, 13]])]
    rows = shared_answer_rows(groups, 0, torch.device("cpu"))
    width = rows.input_ids.shape[1]
    assert rows.used == 13 and width == 14  # 13 real tokens and at least one padding column
    assert rows.input_ids[0, :13].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert rows.position_ids[0, :13].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2, 2, 3]
    # answer-major rows: chosen of group 0, chosen of group 1, rejected of group 0, rejected of group 1
    assert rows.targets.tolist() == [4, 5, 11, 6, 7, 8, 12, 13]
    assert rows.col.tolist() == [2, 3, 9, 2, 5, 6, 9, 11]  # first tokens: the prompt's last state
    assert rows.tokens.tolist() == [2, 1, 3, 2] and rows.shape == (4, 3)
    padded, real = rows.forks
    assert padded.queries.cu_seqlens.tolist()[:6] == [0, 5, 8, 11, 13, 14]
    assert real.queries.cu_seqlens.tolist()[:5] == [0, 5, 8, 11, 13]
    assert real.keys.index.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10, 8, 9, 11, 12]
    assert real.keys.samples.cu_seqlens.tolist()[:5] == [0, 5, 11, 14, 18]
    # 5 prompt rows gathered again, rounded up to quarters of the width (14 // 4 = 3): 14 + 6 keys
    assert padded.keys.samples.max_len == 20 and padded.keys.index.shape == (20,)
    assert padded.keys.samples.cu_seqlens.tolist()[:6] == [0, 5, 11, 14, 18, 20]
    assert padded.keys.index[18:].tolist() == [13, 13]  # one spare key (a copy of the tail's row), then the tail
    for fork in rows.forks:
        assert fork.queries.cu_seqlens.shape == fork.keys.samples.cu_seqlens.shape == (16,)


def test_key_widths_repeat() -> None:
    """The key side's width takes at most four values per row width (CUDA graphs replay shapes)."""
    seen: dict[int, set[int]] = {}
    for prompt in range(1, 40):
        for answer in range(1, 30, 3):
            rows = shared_answer_rows([([5] * prompt, [[6] * answer, [7] * (answer + 2)])], 0, torch.device("cpu"))
            width, key_width = rows.input_ids.shape[1], rows.forks[0].keys.samples.max_len
            assert width > rows.used and key_width >= rows.forks[1].keys.samples.max_len + width - rows.used
            seen.setdefault(width, set()).add(key_width)
    assert max(len(v) for v in seen.values()) <= 4


def test_share_prompt_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match="preference.share_prompt must be one of auto, on, off, got 'yes'"):
        config_from_dict({"model": "demo", "method": "dpo", "preference": {"share_prompt": "yes"}})


def test_share_prompt_choice_is_logged_and_on_is_honoured_or_refused(tiny_model_dir) -> None:
    folder = str(tiny_model_dir("llama"))
    plain, _ = _model(folder, lora=False)  # CPU, no varlen reference: no kernel to fork with
    forking, _ = _model(folder, lora=False, patch=PatchFlags(varlen="reference"))
    config = lambda method, mode: config_from_dict({"model": "demo", "method": method,  # noqa: E731
                                                    "preference": {"share_prompt": mode}})
    logs: list[str] = []
    cb = SimpleNamespace(on_log=logs.append)
    assert share_prompt(config("dpo", "auto"), forking, cb) and "prompt scored once" in logs[-1]
    assert share_prompt(config("orpo", "on"), forking, cb)
    assert not share_prompt(config("dpo", "off"), forking, cb) and "share_prompt: off" in logs[-1]
    assert not share_prompt(config("dpo", "auto"), plain, cb)
    assert "separate sequences" in logs[-1] and "no variable-length attention kernel" in logs[-1]
    with pytest.raises(ConfigError, match="share_prompt: on, but no variable-length attention kernel"):
        share_prompt(config("simpo", "on"), plain, cb)
    count = len(logs)
    assert not share_prompt(config("kto", "auto"), forking, cb) and len(logs) == count  # one answer a row: nothing to say
    with pytest.raises(ConfigError, match="method kto has one answer a row"):
        share_prompt(config("kto", "on"), forking, cb)


@pytest.mark.parametrize(("family", "why"), [("qwen3_5_text", "linear-attention layers carry a recurrent state"),
                                             ("gemma4_text", "share K/V across layers"),
                                             ("gpt_oss", "attention sinks")])
def test_families_that_cannot_fork_say_why(family: str, why: str) -> None:
    model = tiny_model(family, 64)
    patch_model(model, PatchFlags(varlen="reference"))
    assert why in prompt_sharing_refusal(model)


def test_batches_of_one_size_share_every_shape() -> None:
    """Micro-batches whose prompts and answers split differently (14 and 13 prompt tokens) but whose
    totals match run the same shapes and sizes (cu_seqlens, gather index, longest samples): a CUDA
    graph captured for one replays the other."""
    a = shared_answer_rows([([1] * 5, [[2] * 7, [3] * 3]), ([1] * 9, [[2] * 2, [3] * 6])], 0, torch.device("cpu"))
    b = shared_answer_rows([([1] * 6, [[2] * 4, [3] * 5]), ([1] * 7, [[2] * 5, [3] * 5])], 0, torch.device("cpu"))
    assert a.used == b.used and a.forks[1].keys.index.shape != b.forks[1].keys.index.shape  # real keys differ
    x, y = a.forks[0], b.forks[0]
    assert x.queries.cu_seqlens.shape == y.queries.cu_seqlens.shape and x.queries.max_len == y.queries.max_len
    assert x.keys.index.shape == y.keys.index.shape and x.keys.samples.max_len == y.keys.samples.max_len
    assert x.keys.samples.cu_seqlens.shape == y.keys.samples.cu_seqlens.shape
    assert a.input_ids.shape == b.input_ids.shape and a.position_ids.shape == b.position_ids.shape


def test_a_run_scoring_each_prompt_once_follows_the_separate_run(tiny_model_dir, tmp_path, monkeypatch, one_thread) -> None:
    """The whole DPO run (setup's choice, evaluation-free steps, metrics) with share_prompt on and
    off, the model patched with the varlen reference: the same losses, rewards and log-probs; the
    layout that ran is in the metrics."""
    real_load = trainer.load
    monkeypatch.setattr(trainer, "load", lambda *a, **kw: real_load(*a, **{**kw, "patch": PatchFlags(varlen="reference")}))
    data = _subset(tmp_path, "arithmetic_preferences", 12)
    runs = {}
    for mode in ("off", "on"):
        cfg = _config(str(tiny_model_dir("llama")), tmp_path / mode, data, max_steps=3, preference={"share_prompt": mode})
        result = run(config_from_dict(cfg))
        assert result.status == "completed", result.error
        runs[mode] = _metrics(tmp_path / mode)
    assert [m["shared_prompt"] for m in runs["on"]] == [1.0] * 3 and [m["shared_prompt"] for m in runs["off"]] == [0.0] * 3
    for on, off in zip(runs["on"], runs["off"]):
        for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected", "grad_norm"):
            assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-5), key
