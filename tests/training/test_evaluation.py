"""Evaluation: the held-out split, eval_loss against a manual computation, the default interval's
token cost, early stopping with the best weights kept (and exported), TensorBoard events, and
the end-of-run generation check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kestrel.config import config_from_dict
from kestrel.config_evaluation import EarlyStoppingSettings
from kestrel.data import BatchPlan, load_conversations, tokenize_all
from kestrel.data.split import split_rows
from kestrel.errors import ConfigError, DatasetError
from kestrel.model.loader import load
from kestrel.training.evaluation import (
    EVAL_BUDGET, MAX_EVALS, MIN_EVALS, EvalSums, Evaluator, cap_eval_tokens, plan_interval, replay,
)
from kestrel.training.metrics import Callback
from tests.training.test_train import StopAt
from kestrel.training.run import run
from kestrel.training.sft_eval import held_out, sft_evaluator, sft_measure
from tests.support.logs import Logs


def _cfg(model: str, out: Path, **kw) -> dict:
    base = dict(model=model, dataset="arithmetic_chat", output_dir=str(out), max_seq_length=64, batch_size=2,
                max_steps=12, learning_rate=1e-3, save_steps=0, seed=0, gradient_checkpointing="off")
    return {**base, **kw}


# --- the split ----------------------------------------------------------------------------------


def test_split_is_seeded_disjoint_and_keeps_every_row() -> None:
    rows = list(range(200))
    train, held = split_rows(rows, 0.1, seed=7)
    again_train, again_held = split_rows(rows, 0.1, seed=7)
    assert (train, held) == (again_train, again_held)
    assert len(held) == 20 and not set(train) & set(held) and sorted(train + held) == rows
    assert split_rows(rows, 0.1, seed=8)[1] != held  # the seed moves it
    assert held == sorted(held) and train == sorted(train)  # each part keeps the file's order
    with pytest.raises(DatasetError, match="at least 2 usable rows"):
        split_rows([1], 0.1, seed=0)


def test_sft_holds_out_rows_before_tokenizing(demo_tokenizer) -> None:
    cfg = config_from_dict(dict(eval_split=0.05, seed=3))
    _, convs, _ = load_conversations(cfg.dataset)
    train, held = held_out(cfg, convs, Callback())
    lines = lambda cs: {c.line for c in cs}  # noqa: E731
    assert lines(train).isdisjoint(lines(held)) and lines(train) | lines(held) == lines(convs)
    assert len(held) == round(0.05 * len(convs))
    assert lines(held_out(cfg, convs, Callback())[1]) == lines(held)


def test_config_checks_name_the_field() -> None:
    cases = {
        "eval_split must be a fraction": dict(eval_split=0.8),
        "set only one": dict(eval_split=0.1, eval_dataset="val.jsonl"),
        "early_stopping needs an evaluation set": dict(early_stopping={"patience": 2}),
        "eval_steps is set but there is no evaluation set": dict(eval_steps=10),
        "eval_steps must be at least 1": dict(eval_steps=0, eval_split=0.1),
        "early_stopping.min_delta": dict(eval_split=0.1, early_stopping={"patience": 2, "min_delta": -1}),
        "report_to: unknown reporter 'comet'": dict(report_to=["comet"]),
    }
    for words, data in cases.items():
        with pytest.raises(ConfigError, match=words):
            config_from_dict(data)


def test_mlflow_not_installed_is_refused_at_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel import config_evaluation

    monkeypatch.setattr(config_evaluation, "installed", lambda name: False)
    with pytest.raises(ConfigError, match="mlflow is not installed.*pip install mlflow"):
        config_from_dict(dict(report_to=["tensorboard", "mlflow"]))


# --- eval_loss ----------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [False, True])
def test_eval_loss_equals_a_manual_computation(packing: bool, tiny_model_dir, tmp_path: Path) -> None:
    path = str(tiny_model_dir("llama"))
    model, tok = load(path, 64, dtype="fp32")
    model.train()
    _, convs, _ = load_conversations("arithmetic_chat")
    samples = tokenize_all(tok, convs[:7], 64, True).samples
    plan = BatchPlan(samples, 3, packing, 64, tok.pad_token_id, seed=0)
    ev = Evaluator(plan.in_order(), sft_measure, plan_interval(10, 100.0, 10, None), tmp_path,
                   EarlyStoppingSettings())
    got = ev.evaluate(model)["eval_loss"]
    assert model.training and all(p.grad is None for p in model.parameters())
    # By hand: every sample alone through the plain Hugging Face model, summed token losses.
    plain, _ = load(path, 64, dtype="fp32", patch=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            logits = plain(input_ids=torch.tensor([s.input_ids])).logits[0, :-1]  # (T-1, V)
            targets = torch.tensor(s.labels[1:])  # packed or not, a sample's first label is never a target
            total += float(F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"))
            count += int((targets != -100).sum())
    assert got == pytest.approx(total / count, rel=1e-4)


# --- cost of the default interval ---------------------------------------------------------------


@pytest.mark.parametrize("steps,batch,accum,packing", [(30, 2, 1, False), (200, 4, 2, False), (57, 2, 3, True),
                                                      (1000, 8, 1, False)])
def test_default_interval_keeps_eval_within_5_percent_of_training_tokens(
    steps: int, batch: int, accum: int, packing: bool, demo_tokenizer, tmp_path: Path
) -> None:
    cfg = config_from_dict(dict(eval_split=0.2, batch_size=batch, grad_accum=accum, packing=packing,
                                max_seq_length=128, max_steps=steps))
    _, convs, _ = load_conversations(cfg.dataset)
    train, held = held_out(cfg, convs, Callback())
    samples = tokenize_all(demo_tokenizer, train, 128, True).samples
    plan = BatchPlan(samples, batch, packing, 128, demo_tokenizer.pad_token_id, 0)
    ev = sft_evaluator(cfg, demo_tokenizer, held, plan, steps, tmp_path, 0, Callback())
    per_eval = sum(b.tokens for b in ev.batches)
    trained = evaluated = evaluations = 0
    for step in range(steps):  # the tokens a run processes, counted as the SFT loop draws them
        for j in range(accum):
            m = step * accum + j
            trained += plan.batch(m // len(plan), m % len(plan)).tokens
        if ev.due(step + 1, steps):
            evaluated += per_eval
            evaluations += 1
    assert evaluations >= 1 and per_eval > 0
    assert evaluated <= EVAL_BUDGET * trained, (evaluated, trained, ev.plan)


def test_a_large_eval_set_is_bounded_so_enough_evaluations_fit() -> None:
    # 1,000 steps of 2,048 tokens: a 5% budget of 102,400 eval tokens.
    for patience, evaluations in ((0, MIN_EVALS), (8, 10)):
        cap = cap_eval_tokens(1000, 2048.0, patience)
        plan = plan_interval(1000, 2048.0, cap, None)
        assert plan.evaluations(1000) == evaluations and plan.share(1000) <= EVAL_BUDGET
    small = plan_interval(1000, 2048.0, 100, None)  # a tiny eval set: at most MAX_EVALS evaluations
    assert small.evaluations(1000) == MAX_EVALS and small.every == 40


def test_explicit_eval_steps_is_kept_and_evaluates_every_held_out_row(demo_tokenizer, tmp_path: Path) -> None:
    cfg = config_from_dict(dict(eval_split=0.2, eval_steps=7, max_steps=30))
    _, convs, _ = load_conversations(cfg.dataset)
    train, held = held_out(cfg, convs, Callback())
    plan = BatchPlan(tokenize_all(demo_tokenizer, train, 1024, True).samples, 2, False, 1024, 0, 0)
    ev = sft_evaluator(cfg, demo_tokenizer, held, plan, 30, tmp_path, 0, Callback())
    assert ev.plan.every == 7 and sum(len(b.input_ids) for b in ev.batches) == len(held)
    assert [s for s in range(1, 31) if ev.due(s, 30)] == [7, 14, 21, 28, 30]


# --- early stopping and the best weights --------------------------------------------------------


def test_early_stopping_counts_evaluations_without_a_min_delta_improvement() -> None:
    state = replay([(10, 3.0), (20, 2.0), (30, 1.95), (40, 2.5)], min_delta=0.1)
    assert (state.best, state.best_step, state.stale) == (1.95, 30, 2)  # 1.95 is kept but not enough
    assert replay([(10, 3.0), (20, 2.0)], 0.0).stale == 0


def test_best_weights_are_kept_and_early_stopping_ends_the_run(tiny_model_dir, tmp_path: Path) -> None:
    model, _ = load(str(tiny_model_dir("llama")), 64, dtype="fp32")
    scripted = iter([3.0, 2.0, 2.5, 2.6, 1.0])

    def measure(m, batch):
        return EvalSums({"loss": torch.tensor(next(scripted))}, 1.0, 10)

    ev = Evaluator([None], measure, plan_interval(100, 1000.0, 10, 10), tmp_path,
                   EarlyStoppingSettings(patience=2))
    logs: list[str] = []
    name, weight = next(iter(model.named_parameters()))
    stopped = []
    for step in (10, 20, 30, 40):
        with torch.no_grad():
            weight.fill_(step)  # the weights of each evaluation, recognisable later
        stopped.append(ev.record(step, ev.evaluate(model), model, None, logs.append))
    assert stopped == [False, False, False, True]
    marker = json.loads((tmp_path / "best" / "best.json").read_text())
    assert marker == {"step": 20, "metric": "eval_loss", "value": 2.0}
    from safetensors.torch import load_file

    saved = load_file(str(next((tmp_path / "best" / "model").glob("*.safetensors"))))
    assert torch.equal(saved[name], torch.full_like(weight, 20.0))
    assert any("early stopping at step 40" in line and "step 20" in line for line in logs)


def test_run_stops_early_keeps_the_best_and_export_picks_it(tiny_model_dir, tmp_path: Path) -> None:
    from kestrel.export import export
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    logs = Logs()
    # min_delta far above any change: the first evaluation is the bar, two more without beating it stop.
    cfg = _cfg(str(tiny_model_dir("llama")), out, max_steps=40, eval_split=0.1, eval_steps=3,
               early_stopping={"patience": 2, "min_delta": 100.0})
    result = run(config_from_dict(cfg), [logs])
    assert (result.status, result.step) == ("completed", 9)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    assert [s for s, _ in evals] == [3, 6, 9] and max(r["step"] for r in rows) == 9
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["value"] == pytest.approx(min(v for _, v in evals)) and (out / "best" / "adapter").is_dir()
    assert any(line.startswith("early stopping at step 9") for line in logs.lines)
    # TensorBoard: event files in the run folder, eval/loss at the evaluated steps (HF Trainer tags).
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/loss")] == [3, 6, 9]
    assert len(acc.Scalars("train/loss")) == 9
    # The export takes the best weights and says so.
    exported = export(out, "adapter", tmp_path / "export", check=False)
    assert any(f"eval_loss {best['value']:.4f} at step {best['step']}" in n for n in exported.notes)
    assert "best weights" in exported.summary()
    from safetensors.torch import load_file

    want = load_file(str(out / "best" / "adapter" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "export" / "adapter_model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


# --- the generation check -----------------------------------------------------------------------


def test_generation_check_answers_held_out_prompts_and_scores_them(tiny_model_dir, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run(config_from_dict(_cfg(str(tiny_model_dir("llama")), out, max_steps=4, eval_split=0.05)))
    assert result.status == "completed"
    check = json.loads((out / "generation_check.json").read_text())
    _, convs, _ = load_conversations("arithmetic_chat")
    by_line = {c.line: c for c in convs}
    assert check["step"] == 4 and len(check["rows"]) == 8
    for row in check["rows"]:
        conv = by_line[row["line"]]
        assert row["reference"] == conv.messages[-1]["content"] and row["prompt"] == conv.messages[-2]["content"]
        assert isinstance(row["answer"], str) and 0.0 <= row["rouge_l"] <= 1.0
    assert check["rouge_l"] == pytest.approx(sum(r["rouge_l"] for r in check["rows"]) / 8)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1] == {"step": 4, "eval_exact_match": check["exact_match"], "eval_rouge_l": check["rouge_l"]}


class _FakeGenerator:
    """Stands in for the decode path: records how it was made and what it was asked."""

    made: list[dict] = []
    instances: list["_FakeGenerator"] = []

    def __init__(self, model, tokenizer, **kw) -> None:
        _FakeGenerator.made.append(kw)
        _FakeGenerator.instances.append(self)
        self.stop_ids, self.closed, self.released = [0], False, False

    def chunks(self, prompts, max_new_tokens, adapter=None):
        from kestrel.decode.generate import TokenChunk
        yield TokenChunk([[5, 6, 0] for _ in prompts], ["stop"] * len(prompts))

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        self.released = True


def test_the_check_decodes_its_one_batch_uncompiled_and_reuses_a_runs_generator(monkeypatch, tmp_path: Path) -> None:
    """Its own generator is made with compile=False (one batch never repays compiling the step) and
    closed afterwards; a run's generator (GRPO's, compiled for its rollouts) is used as is and only
    released."""
    from types import SimpleNamespace

    from kestrel.decode import generate
    from kestrel.training.generation_check import GenerationCase, GenerationCheck

    monkeypatch.setattr(generate, "Generator", _FakeGenerator)
    monkeypatch.setattr(_FakeGenerator, "made", [])
    monkeypatch.setattr(_FakeGenerator, "instances", [])
    tokenizer = SimpleNamespace(batch_decode=lambda rows, **kw: [" ".join(map(str, r)) for r in rows])
    model = torch.nn.Linear(1, 1)
    cases = [GenerationCase([1, 2, 3], "q", "5 6", 1), GenerationCase([1, 2], "p", "7", 2)]
    GenerationCheck(cases, 8).run(model, tokenizer, tmp_path, step=3)
    assert _FakeGenerator.made == [{"max_seq_len": 3 + 8, "compile": False}]
    assert _FakeGenerator.instances[0].closed  # its own: the model's projections get their storage back
    own = _FakeGenerator(model, tokenizer)
    GenerationCheck(cases, 8, own).run(model, tokenizer, tmp_path, step=4)
    assert len(_FakeGenerator.made) == 2 and own.released and not own.closed  # no generator made for it
    assert json.loads((tmp_path / "generation_check.json").read_text())["step"] == 4


class _TimedChunks:
    """A generator whose chunks (the prefill's token, then one token each) arrive at the
    scripted clock readings `arrivals` (seconds); the check's own reads of the clock see them."""

    def __init__(self, arrivals: list[float]) -> None:
        self.arrivals, self.now, self.stop_ids, self.sent = arrivals, 0.0, [0], 0

    def clock(self) -> float:
        return self.now

    def chunks(self, prompts, max_new_tokens, adapter=None):
        from kestrel.decode.generate import TokenChunk
        for t in self.arrivals:
            self.now, self.sent = t, self.sent + 1
            yield TokenChunk([[7] for _ in prompts], [None] * len(prompts))


@pytest.mark.parametrize(("deadline", "kept"), [(2.5, 3), (2.9, 3), (3.0, 4), (0.5, 2), (0.1, 1), (None, 5)])
def test_a_check_stops_before_the_chunk_that_would_end_past_its_deadline(monkeypatch, deadline, kept) -> None:
    """Chunks arrive at 0.2 (the prefill), 1.0, 2.0, 3.0, 4.0 s: each decoding chunk takes 1 s, so
    with the deadline at 2.5 s the check stops at the chunk of 2.0 s (the next would end at 3.0),
    and at 3.0 it takes that one. The first chunk is kept whatever the deadline; after it, the next
    chunk's time is unknown, so it is decoded when the deadline has not yet come (0.5 s)."""
    from kestrel.training import generation_check
    from kestrel.training.generation_check import GenerationCase, GenerationCheck

    gen = _TimedChunks([0.2, 1.0, 2.0, 3.0, 4.0])
    monkeypatch.setattr(generation_check.time, "perf_counter", gen.clock)
    check = GenerationCheck([GenerationCase([1], "q", "7", 1)], 8, gen)
    tokens, reasons = check.answer(gen, None, deadline)
    assert tokens == [[7] * kept] and gen.sent == kept and reasons == ["time"]


def _tiny_check(tiny_model_dir, max_new_tokens: int):
    """The tiny model (eval mode), its tokenizer, a check of 8 held-out arithmetic prompts whose
    answers may run to `max_new_tokens`, and a generator sized for it that reads every 4 tokens."""
    from kestrel.decode.generate import Generator
    from kestrel.training.generation_check import GenerationCheck

    model, tokenizer = load(str(tiny_model_dir("llama")), 256, dtype="fp32")
    model.eval()
    _, convs, _ = load_conversations("arithmetic_chat")
    cases = GenerationCheck.from_conversations(convs, tokenizer, 64).cases
    longest = max(len(c.ids) for c in cases)
    generator = Generator(model, tokenizer, max_seq_len=longest + max_new_tokens, sync_every=4)
    return model, tokenizer, GenerationCheck(cases, max_new_tokens, generator)


def test_a_check_out_of_time_keeps_the_first_chunk_of_each_answer_and_marks_it(tiny_model_dir, tmp_path) -> None:
    """seconds=0: the time is spent before the first token, so each answer is its first chunk
    (the prefill's token), marked "time" unless it had ended there; the generator (a run's, as
    GRPO passes) is released and serves the next request."""
    from kestrel.training.grpo.rollout import decode_completions

    model, tokenizer, check = _tiny_check(tiny_model_dir, 40)
    prompts = [c.ids for c in check.cases]
    full = check.generator.generate(prompts, max_new_tokens=40)
    assert any(len(t) > 4 for t in full.tokens)  # more than one chunk would be decoded
    summary = check.run(model, tokenizer, tmp_path, step=5, seconds=0.0)
    first = decode_completions(tokenizer, [t[:1] for t in full.tokens], check.generator.stop_ids)
    assert [r["answer"] for r in summary["rows"]] == [a.strip() for a in first]
    want = ["stop" if len(t) == 1 and r == "stop" else "time" for t, r in zip(full.tokens, full.finish_reasons)]
    assert [r["finished"] for r in summary["rows"]] == want and "time" in want
    assert summary["stopped_early"] == want.count("time") and summary["seconds"] == 0.0
    assert json.loads((tmp_path / "generation_check.json").read_text()) == summary
    assert check.generator._session is None  # released
    assert check.generator.generate(prompts, max_new_tokens=40).tokens == full.tokens  # not left busy


def test_a_check_without_a_time_budget_answers_in_full(tiny_model_dir, tmp_path) -> None:
    from kestrel.training.grpo.rollout import decode_completions

    model, tokenizer, check = _tiny_check(tiny_model_dir, 40)
    full = check.generator.generate([c.ids for c in check.cases], max_new_tokens=40)
    stops, check.generator = check.generator.stop_ids, None  # the check makes its own, of the same size
    summary = check.run(model, tokenizer, tmp_path, step=5)
    answers = decode_completions(tokenizer, full.tokens, stops)
    assert [r["answer"] for r in summary["rows"]] == [a.strip() for a in answers]
    assert [r["finished"] for r in summary["rows"]] == full.finish_reasons
    assert summary["stopped_early"] == 0 and summary["seconds"] is None


def test_a_run_whose_check_runs_out_of_time_says_so(tiny_model_dir, tmp_path: Path, monkeypatch) -> None:
    """The end-of-run check gets the schedule's seconds; when they cut answers, the log says how
    many, why, and how to get them in full."""
    from kestrel.training.eval_schedule import EvalSchedule

    monkeypatch.setattr(EvalSchedule, "check_seconds", lambda self: 0.0)  # nothing left of the budget
    out, logs = tmp_path / "run", Logs()
    result = run(config_from_dict(_cfg(str(tiny_model_dir("llama")), out, max_steps=4, eval_split=0.05)), [logs])
    assert result.status == "completed", result.error
    check = json.loads((out / "generation_check.json").read_text())
    cut = sum(r["finished"] == "time" for r in check["rows"])
    assert check["seconds"] == 0.0 and check["stopped_early"] == cut > 0
    assert all(r["finished"] in ("stop", "length", "time") for r in check["rows"])
    line = next(x for x in logs.lines if "time budget" in x)
    assert f"{cut} of 8 answers stopped at its time budget of 0.0 s" in line and "within 5% of the training time" in line
    assert "'Check generations'" in line and f"python -m kestrel.training.check_run {out} --weights {out} --step 4" in line


def test_resume_restores_early_stopping_from_the_evaluations_before_the_checkpoint(tiny_model_dir, tmp_path: Path) -> None:
    cfg = _cfg(str(tiny_model_dir("llama")), tmp_path / "straight", max_steps=40, eval_split=0.1, eval_steps=2,
               early_stopping={"patience": 3, "min_delta": 100.0})
    straight = run(config_from_dict(cfg))
    resumed_cfg = {**cfg, "output_dir": str(tmp_path / "resumed")}
    paused = run(config_from_dict(resumed_cfg), [StopAt(4)])  # after two evaluations: one to go
    resumed = run(config_from_dict(resumed_cfg))
    assert (straight.step, paused.status, paused.step, resumed.step) == (8, "interrupted", 4, 8)
    evals = lambda out: [(r["step"], r["eval_loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())  # noqa: E731
                         if "eval_loss" in r]
    got, want = evals(tmp_path / "resumed"), evals(tmp_path / "straight")
    assert [s for s, _ in got] == [s for s, _ in want] == [2, 4, 6, 8]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-4)


def test_grpo_evaluates_held_out_prompts_by_reward(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    out = tmp_path / "grpo"
    grpo = dict(num_generations=4, max_completion_length=8, max_prompt_length=48,
                rewards=[{"name": "format_regex", "pattern": "[0-9]"}, {"name": "exact_answer", "weight": 0.5}])
    cfg = dict(model=str(tiny_model_dir("llama")), method="grpo", dataset="arithmetic_prompts", output_dir=str(out),
               max_seq_length=256, batch_size=2, max_steps=4, learning_rate=2e-3, save_steps=0, seed=0,
               gradient_checkpointing="off", dtype="fp32", grpo=grpo, lora={"r": 8, "alpha": 16}, eval_split=0.05,
               eval_steps=2)
    result = run(config_from_dict(cfg))
    assert result.status == "completed", result.error
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        parts = r["eval_reward/format_regex"] + 0.5 * r["eval_reward/exact_answer"]
        assert r["eval_reward"] == pytest.approx(parts, abs=1e-6) and 0.0 <= r["eval_reward/format_regex"] <= 1.0
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["metric"] == "eval_reward" and best["value"] == pytest.approx(max(r["eval_reward"] for r in evals))
    check = json.loads((out / "generation_check.json").read_text())
    assert 1 <= len(check["rows"]) <= 8 and all(row["reference"].strip() for row in check["rows"])


def test_a_best_save_killed_midway_is_cleaned_at_the_next_start(tmp_path: Path) -> None:
    from kestrel.training.best import read_best
    from kestrel.training.checkpoints import remove_stale_writes

    (tmp_path / "best" / "adapter.tmp").mkdir(parents=True)  # killed inside save_weights: no marker yet
    assert read_best(tmp_path) is None
    assert remove_stale_writes(tmp_path) == [tmp_path / "best" / "adapter.tmp"]
    assert not (tmp_path / "best" / "adapter.tmp").exists()
