"""GRPO runs end to end on the CPU: the reward picks the verified answer, metrics, resume, reused
batches, prompt datasets and configuration errors. The shipped demo (demo_sft.yaml, then
demo_grpo.yaml) is tested in test_demo_learns.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel.config import config_from_dict
from kestrel.errors import ConfigError, DatasetError
from kestrel.training.grpo.data import load_prompts, prompts_for_step
from kestrel.paths import SAMPLE_DATASETS
from kestrel.training.run import run
from tests.training.test_train import StopAt

STEP_KEYS = ("step", "total_steps", "epoch", "elapsed_s", "eta_s", "loss", "lr", "grad_norm", "tokens_per_s",
             "reward", "reward_std", "kl", "clip_frac", "completion_len_mean", "completion_len_max",
             "vram_alloc_gib", "vram_reserved_gib", "vram_peak_gib")



def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _grpo(model: str, out: Path, dataset: str, **kw) -> dict:
    grpo = dict(num_generations=4, max_completion_length=8, max_prompt_length=48, beta=0.04, temperature=1.0)
    grpo.update(kw.pop("grpo", {}))
    base = dict(model=model, method="grpo", dataset=dataset, output_dir=str(out), max_seq_length=256, batch_size=2,
                max_steps=4, learning_rate=2e-3, save_steps=0, seed=0, gradient_checkpointing="off", dtype="fp32",
                lr_scheduler="constant", grpo=grpo, lora={"r": 8, "alpha": 16})
    return {**base, **kw}


def test_reward_picks_the_verified_answer_among_equal_guesses(tmp_path: Path, one_thread) -> None:
    """Demo model, demo prompts, exact-answer reward. The SFT data gives every question its right
    answer and two near misses, so SFT settles at about 1/3 right (the answers are single tokens,
    a fixed point of maximum likelihood, not a lucky moment of training); only the reward can then
    find the verified one. Fixed seeds; the margin is about half the rise this run shows (0.29 over
    the first 8 steps, 0.61 over the last 8)."""
    rows = [json.loads(line) for line in (SAMPLE_DATASETS / "arithmetic_prompts.jsonl").read_text().splitlines()[:16]]
    prompts, sft = tmp_path / "prompts.jsonl", tmp_path / "sft.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(sft, "w") as f:
        for r in rows:
            for guess in (int(r["answer"]), int(r["answer"]) + 1, int(r["answer"]) + 10):
                msgs = [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": f"The answer is {guess}."}]
                f.write(json.dumps({"messages": msgs}) + "\n")
    warm = run(config_from_dict(dict(model="demo", method="full", dataset=str(sft), output_dir=str(tmp_path / "sft"),
                                     max_seq_length=64, batch_size=16, max_steps=60, learning_rate=1e-3, save_steps=0,
                                     seed=0, gradient_checkpointing="off", lr_scheduler="constant", dtype="fp32")))
    assert warm.status == "completed"
    cfg = _grpo(str(tmp_path / "sft" / "model"), tmp_path / "grpo", str(prompts), batch_size=4, max_steps=32,
                grpo=dict(num_generations=8, max_completion_length=16))
    result = run(config_from_dict(cfg))
    assert result.status == "completed", result.error
    rewards = [m["reward"] for m in _metrics(tmp_path / "grpo")]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert 0.05 < first < 0.5, rewards  # the SFT start is neither hopeless nor solved
    assert last > first + 0.15, rewards
    assert (tmp_path / "grpo" / "adapter" / "adapter_config.json").is_file()



def test_metrics_and_resume_reproduce_the_straight_run(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    model = str(tiny_model_dir("llama"))
    kw = dict(max_steps=4, grpo=dict(rewards=[{"name": "format_regex", "pattern": "[0-9]"},
                                              {"name": "length_penalty", "target_length": 4, "weight": 0.5}]))
    straight = run(config_from_dict(_grpo(model, tmp_path / "a", "arithmetic_prompts", **kw)))
    paused = run(config_from_dict(_grpo(model, tmp_path / "b", "arithmetic_prompts", **kw)), [StopAt(2)])
    assert (straight.status, paused.status, paused.step) == ("completed", "interrupted", 2)
    resumed = run(config_from_dict(_grpo(model, tmp_path / "b", "arithmetic_prompts", **kw)))
    assert resumed.status == "completed"
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for key in STEP_KEYS + ("reward/format_regex", "reward/length_penalty"):
        assert key in a[0], key
    for x, y in zip(a, b):  # rollouts are seeded per step: the resumed run samples the same rows
        for key in ("reward", "completion_len_mean", "loss", "kl"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key
    assert a[0]["kl"] == pytest.approx(0.0, abs=1e-6) and a[-1]["kl"] > 0  # starts at the reference
    assert all(m["completion_len_max"] <= 8 and m["clip_frac"] == 0.0 for m in a)


def test_checkpointing_modes_give_the_same_steps(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    """The chunked log-prob path through off / standard / offload checkpointing: identical runs."""
    curves = {}
    for mode in ("off", "standard", "offload"):
        cfg = _grpo(str(tiny_model_dir("llama")), tmp_path / mode, "arithmetic_prompts", max_steps=3,
                    gradient_checkpointing=mode, grpo={"rewards": [{"name": "format_regex", "pattern": "[0-9]"}]})
        assert run(config_from_dict(cfg)).status == "completed"
        curves[mode] = [m[key] for m in _metrics(tmp_path / mode) for key in ("loss", "kl", "grad_norm")]
    assert curves["off"][-2] > 0  # the adapter moved (kl > 0): the comparison is not of zeros
    assert curves["standard"] == pytest.approx(curves["off"], rel=1e-5, abs=1e-9)
    assert curves["offload"] == pytest.approx(curves["off"], rel=1e-5, abs=1e-9)


def test_reused_batches_take_clipped_steps(tiny_model_dir, tmp_path: Path, one_thread) -> None:
    """num_iterations = 2: the second update reuses the rollouts, with ratios away from 1."""
    cfg = config_from_dict(_grpo(str(tiny_model_dir("llama")), tmp_path / "r", "arithmetic_prompts", learning_rate=5e-2,
                                 grpo=dict(beta=0.0, epsilon=0.05, rewards=[{"name": "format_regex", "pattern": "[0-9]"}])))
    cfg.grpo.num_iterations = 2  # proposed GrpoSettings field; the trainer reads it when present
    assert run(cfg).status == "completed"
    m = _metrics(tmp_path / "r")
    assert m[0]["completion_len_mean"] == m[1]["completion_len_mean"] and m[0]["reward"] == m[1]["reward"]
    assert m[0]["clip_frac"] == 0.0 and any(x["clip_frac"] > 0 for x in m[1::2])


def test_custom_reward_needs_the_opt_in(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text("def reward(p, c, a):\n    return [0.0] * len(c)\n")
    cfg = _grpo("demo", tmp_path / "c", "arithmetic_prompts", grpo=dict(rewards=[{"name": "custom", "path": str(tmp_path / "r.py")}]))
    with pytest.raises(ConfigError, match="allow_custom_rewards: true"):  # refused before any job starts
        config_from_dict(cfg)
    cfg["grpo"]["allow_custom_rewards"] = True
    assert config_from_dict(cfg).grpo.allow_custom_rewards


def test_prompt_datasets(demo_tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [
        {"question": "What is 1 + 1?", "solution": "2"},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "The answer is 4."}]},
        {"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 3?"}], "solution": "6"},
        {"question": "no answer here"},
        {"question": "word " * 80, "solution": "1"},
        {"question": ""},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config_from_dict(_grpo("demo", tmp_path / "o", str(path), columns={"prompt": "question", "answer": "solution"}))
    good, bad, too_long = load_prompts(cfg, demo_tokenizer, needs_answers=True)
    assert [(g.text, g.answer, g.line) for g in good] == [
        ("What is 1 + 1?", "2", 1), ("What is 2 + 2?", "The answer is 4.", 2), ("What is 3 + 3?", "6", 3)]
    assert demo_tokenizer.decode(good[2].ids).startswith("<|im_start|>system\nBe brief.")
    assert demo_tokenizer.decode(good[0].ids).endswith("<|im_start|>assistant\n")
    assert [(b.line, b.reason.split()[0]) for b in bad] == [(4, "no"), (6, "empty")] and too_long == 1
    good, _, _ = load_prompts(cfg, demo_tokenizer, needs_answers=False)
    assert len(good) == 4  # without exact_answer, a prompt needs no answer
    order = [r.line for step in range(4) for r in prompts_for_step(good, step, 2, seed=0)]
    assert sorted(order[:4]) == sorted(order[4:]) == [1, 2, 3, 4]  # every prompt once per epoch
    path.write_text(json.dumps({"text": "nothing usable"}) + "\n")
    with pytest.raises(DatasetError, match="none of its 1 rows is a usable GRPO prompt"):
        load_prompts(cfg, demo_tokenizer, needs_answers=False)


def test_prompt_datasets_with_common_column_names_need_no_mapping(demo_tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"Question": "What is 1 + 1?", "solution": "2"}) + "\n")
    cfg = config_from_dict(_grpo("demo", tmp_path / "o", str(path)))
    good, bad, _ = load_prompts(cfg, demo_tokenizer, needs_answers=True)
    assert [(g.text, g.answer) for g in good] == [("What is 1 + 1?", "2")] and not bad


def test_demo_configs_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.config import load_config
    from kestrel.paths import ASSETS

    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    sft, grpo = (load_config(ASSETS / "configs" / f"demo_{name}.yaml") for name in ("sft", "grpo"))
    assert (sft.method, grpo.method) == ("full", "grpo")
    # Under KESTREL_HOME, where the studio lists runs from, whatever it is set to.
    assert sft.output_dir == str(tmp_path / "home" / "runs" / "demo-sft")
    assert grpo.output_dir == str(tmp_path / "home" / "runs" / "demo-grpo")
    assert grpo.model == str(sft.output_dir) + "/model"  # step 2 starts where step 1 saved
    assert [r.name for r in grpo.grpo.rewards] == ["exact_answer"]


@pytest.mark.parametrize("family", ["qwen3_5_text", "gemma4_text", "qwen3_5_moe_text"])
def test_a_family_without_the_fast_decode_path_samples_through_hf(family: str, tiny_model_dir, tmp_path: Path,
                                                                   one_thread) -> None:
    """GRPO's rollouts run through Hugging Face's forward and cache where Kestrel's decode forward
    does not reach (linear attention, per-layer inputs): the run completes and learns a reward."""
    kw = dict(max_steps=2, grpo=dict(rewards=[{"name": "format_regex", "pattern": "[0-9]"}]))
    result = run(config_from_dict(_grpo(str(tiny_model_dir(family)), tmp_path / family, "arithmetic_prompts", **kw)))
    assert result.status == "completed", result
    metrics = _metrics(tmp_path / family)
    assert [m["step"] for m in metrics] == [1, 2] and all(0 < m["completion_len_mean"] <= 8 for m in metrics)
