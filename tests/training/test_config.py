from __future__ import annotations

import pytest

from kestrel.config import TrainConfig, config_from_dict, load_config, parse_overrides
from kestrel.errors import ConfigError


def test_yaml_round_trip_and_overrides(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: demo\nmethod: lora\nlora:\n  r: 4\n")
    cfg = load_config(path, ["--lora.alpha", "8", "--max_steps", "3", "--packing", "true"])
    assert (cfg.lora.r, cfg.lora.alpha, cfg.max_steps, cfg.packing) == (4, 8, 3, True)
    assert config_from_dict(__import__("yaml").safe_load(cfg.to_yaml())) == cfg


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"learning_rat": 1e-4}, "unknown config key learning_rat; valid keys: batch_size"),
        ({"lora": {"rank": 8}}, "unknown config key lora.rank; valid keys under lora: alpha, dropout, init_from, r, targets"),
        ({"grpo": {"rewards": [{"nam": "x"}]}}, "unknown config key grpo.rewards[].nam"),
        ({"method": "ppo"}, "method must be one of qlora, lora, full, grpo, dpo, orpo, kto, simpo, got 'ppo'"),
        ({"method": "dpo", "preference": {"loss_type": "cdpo"}},
         "preference.loss_type must be one of sigmoid, ipo, hinge, robust, exo_pair, nca_pair, bco_pair, sppo_hard, "
         "apo_zero, apo_down, got 'cdpo'"),
        ({"preference": {"label_smoothing": 0.5, "loss_type": "robust"}}, "preference.label_smoothing must be in [0, 0.5)"),
        ({"preference": {"label_smoothing": 0.1}}, "label_smoothing is read only by loss_type robust and exo_pair, not 'sigmoid'"),
        ({"preference": {"loss_type": "exo_pair"}}, "loss_type exo_pair needs label_smoothing > 0"),
        ({"preference": {"beta": 0}}, "preference.beta must be in (0, 1000], got 0.0"),
        ({"preference": {"finetune": "dora"}}, "preference.finetune must be one of lora, qlora, full, got 'dora'"),
        ({"preference": {"undesirable_weight": -1}}, "preference.undesirable_weight must be in (0, 1000], got -1.0"),
        ({"preference": {"simpo_gamma": -0.5}}, "preference.simpo_gamma must be 0..100, got -0.5"),
        ({"preference": {"lambda": 0.1}}, "unknown config key preference.lambda; valid keys under preference: beta"),
        ({"preference": {"precompute_ref_logps": "yes"}}, "preference.precompute_ref_logps must be true or false"),
        ({"gradient_checkpointing": "yes"}, "gradient_checkpointing must be one of auto, off, standard, offload"),
        ({"batch_size": 0}, "batch_size must be 1..4096"),
        ({"learning_rate": 3}, "learning_rate must be in (0, 1)"),
        ({"lora": {"dropout": 1.5}}, "lora.dropout must be in [0, 1)"),
        ({"lora": "big"}, "lora must be a mapping"),
        ({"batch_size": "many"}, "batch_size must be a whole number, got 'many'"),
        ({"packing": "yes"}, "packing must be true or false, got 'yes'"),
    ],
)
def test_bad_configs_name_the_problem(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert needle in str(err.value)


def test_override_syntax_errors() -> None:
    with pytest.raises(ConfigError, match="--key value pairs"):
        parse_overrides(["--max_steps"])
    assert parse_overrides(["--lora.targets", "[q_proj, v_proj]"]) == {"lora": {"targets": ["q_proj", "v_proj"]}}


def test_missing_config_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_qlora_flag() -> None:
    assert TrainConfig(method="qlora").load_in_4bit and not TrainConfig(method="lora").load_in_4bit


def test_kestrel_home_in_a_path_is_expanded(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from kestrel.config import config_from_dict

    monkeypatch.setenv("KESTREL_HOME", str(tmp_path))
    cfg = config_from_dict({"output_dir": "${KESTREL_HOME}/runs/a", "model": "$KESTREL_HOME/runs/b/model",
                            "dataset": "$KESTREL_HOMEX/data.jsonl", "lora": {"init_from": "$KESTREL_HOME"}})
    assert cfg.output_dir == f"{tmp_path}/runs/a" and cfg.model == f"{tmp_path}/runs/b/model"
    assert cfg.dataset == "$KESTREL_HOMEX/data.jsonl" and cfg.lora.init_from == str(tmp_path)  # only the whole name
