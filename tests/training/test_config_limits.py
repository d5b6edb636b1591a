"""Hostile configs (issues 29 and 30): limits on the YAML itself (size, depth, alias expansion,
encoding), the kind of every value (list items, mapping values, finite numbers, int64), sane
ranges naming the field, YAML-style booleans for text fields, and a run that stops `failed` at the
first non-finite loss instead of ending `completed` with a NaN model.

The submit side (nothing stored for a refused config) and the fuzz test are in
tests/jobs/test_submit_hostile.py."""

from __future__ import annotations

import math
import time
from pathlib import Path

import gradio as gr
import pytest

from kestrel.config import check_output_dir, config_from_dict, load_config, parse_overrides
from kestrel.constants import DATASET_FORMATS, REWARD_NAMES
from kestrel.errors import ConfigError
from kestrel.safe_yaml import MAX_BYTES, parse_config_text
from tests.support.hostile import alias_bomb


def _refused(data: dict, *needles: str) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    message = str(err.value)
    for needle in needles:
        assert needle in message, message
    assert "\n" not in message
    return message


def _yaml_refused(tmp_path: Path, text: str | bytes, *needles: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


# --- 30.2: the alias bomb, list items and mapping values ----------------------------------------


def test_a_713_byte_alias_bomb_is_refused_fast(tmp_path: Path) -> None:
    bomb = alias_bomb()
    assert len(bomb.encode()) == 713
    started = time.perf_counter()
    _yaml_refused(tmp_path, bomb, "aliases", "expand to more than 10,000 values")
    with pytest.raises(gr.Error, match="the YAML box: its aliases"):
        from kestrel.studio.handlers import train

        train.apply_yaml(bomb)
    assert time.perf_counter() - started < 1.0


def test_a_few_aliases_are_fine_and_a_recursive_one_is_refused(tmp_path: Path) -> None:
    text = "model: demo\nlora:\n  targets: &t [q_proj, v_proj]\n  r: &r 8\n  alpha: *r\n"
    cfg = parse_config_text(text, "x")
    assert config_from_dict(cfg).lora.alpha == 8
    _yaml_refused(tmp_path, "lora: &x {targets: *x}\n", "contains itself")


def test_list_items_and_mapping_values_are_type_checked() -> None:
    assert config_from_dict({"lora": {"targets": "q_proj"}}).lora.targets == ["q_proj"]  # never characters
    assert config_from_dict({"lora": {"targets": "q_proj, v_proj"}}).lora.targets == ["q_proj", "v_proj"]
    _refused({"lora": {"targets": ["q_proj", 5]}}, "lora.targets[1] must be text, got 5")
    _refused({"lora": {"targets": {"q_proj": 1}}}, "lora.targets must be a list")
    _refused({"lora": {"targets": ""}}, "lora.targets must name at least one module")
    _refused({"columns": {"prompt": 5}}, "columns.prompt must be text, got 5")
    _refused({"columns": ["question"]}, "columns must be a mapping")
    _refused({"columns": {1: "question"}}, "columns: keys must be text")
    _refused({"grpo": {"rewards": {"name": "exact_answer"}}}, "grpo.rewards must be a list")


# --- 30.4: one line, not a traceback ------------------------------------------------------------


@pytest.mark.parametrize("text, needle", [
    ("- model: demo\n- x\n", "must be a mapping of keys to values (key: value lines), got a list"),
    ("just words\n", "must be a mapping of keys to values (key: value lines), got a single text"),
    (b"model: demo\nname: caf\xe9\n", "is not UTF-8 text (byte 0xe9"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "holds binary data"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nests more than 20 levels deep"),
    ("model: demo\n  bad: indent\n", "is not valid YAML: line 2"),
    ("model: !!python/object/apply:os.system [ls]\n", "is not valid YAML"),
    ("a: 1\n---\nb: 2\n", "is not valid YAML"),
    ("seed: " + "9" * 5000 + "\n", "is not valid YAML"),
])
def test_unreadable_yaml_is_one_line_naming_the_file(tmp_path: Path, text: str | bytes, needle: str) -> None:
    _yaml_refused(tmp_path, text, needle)


def test_oversized_config_is_refused_before_parsing(tmp_path: Path) -> None:
    text = "model: demo\nsystem_prompt: '" + "x" * MAX_BYTES + "'\n"
    _yaml_refused(tmp_path, text, "limited to 256 KiB")
    with pytest.raises(ConfigError, match="the YAML box is .* bytes; configs are limited"):
        parse_config_text(text, "the YAML box")


def test_missing_or_special_config_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="does not exist .or is not a file."):
        load_config("/dev/zero")  # a device is never read
    with pytest.raises(ConfigError, match="cannot be read|does not exist"):
        load_config(tmp_path / ("x" * 300))


@pytest.mark.parametrize("data, needles", [
    ({"seed": 2**80}, ("seed", "does not fit in 64 bits")),
    ({"seed": 2**33}, ("seed must be 0..4294967295",)),
    ({"seed": -1}, ("seed must be 0..",)),
    ({"epochs": math.inf}, ("epochs must be a finite number",)),
    ({"grpo": {"top_p": 0}}, ("grpo.top_p must be in (0, 1]",)),
    ({"grpo": {"top_p": -0.5}}, ("grpo.top_p must be in (0, 1]",)),
    ({"grpo": {"top_p": math.nan}}, ("grpo.top_p must be a finite number",)),
    ({"grpo": {"num_generations": 1e9}}, ("grpo.num_generations must be 2..1024",)),
    ({"grpo": {"num_generations": 1}}, ("grpo.num_generations must be 2..1024",)),
    ({"max_steps": 2**63}, ("max_steps", "64 bits")),
    ({"max_steps": 2**63 - 1}, ("max_steps must be at most 10,000,000",)),
    ({"output_dir": "runs/a\x00b"}, ("output_dir must not contain",)),
    ({"output_dir": "x" * 300}, ("output_dir has a part over 255 bytes",)),
    ({"output_dir": "a/" * 600}, ("output_dir is 1,200 characters long; at most 1,024",)),
])
def test_values_that_crashed_later_are_refused_naming_the_field(data: dict, needles: tuple[str, ...]) -> None:
    _refused(data, *needles)


def test_output_dir_that_is_a_file_or_a_device(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path, needle in ((str(afile), "is a file (or a device), not a folder"), ("/dev/null", "is a file"),
                         (str(afile / "sub"), f"cannot be created: {afile} is a file")):
        with pytest.raises(ConfigError, match="output_dir") as err:
            check_output_dir(path)
        assert needle in str(err.value)
    assert check_output_dir(str(tmp_path / "new" / "run")) == tmp_path / "new" / "run"
    assert not (tmp_path / "new").exists()  # checked, not created


# --- 30.5 and 29: refused though accepted before, with the field named ----------------------------


@pytest.mark.parametrize("data, needles", [
    ({"weight_decay": math.inf}, ("weight_decay must be a finite number",)),
    ({"weight_decay": 1e6}, ("weight_decay must be at most",)),
    ({"grpo": {"beta": math.inf}}, ("grpo.beta must be a finite number",)),
    ({"grpo": {"rewards": [{"name": "exact_answer", "weight": math.nan}]}}, ("grpo.rewards[].weight", "finite")),
    ({"grpo": {"rewards": [{"name": "exact_answer", "weight": -math.inf}]}}, ("grpo.rewards[].weight", "finite")),
    ({"grpo": {"num_iterations": 0}}, ("grpo.num_iterations must be 1..100",)),
    ({"grpo": {"num_iterations": -1}}, ("grpo.num_iterations must be 1..100",)),
    ({"lora": {"alpha": 1e30}}, ("lora.alpha", "64 bits")),
    ({"lora": {"alpha": 10**6}}, ("lora.alpha must be at most 8,192",)),
    ({"max_steps": 1e12}, ("max_steps must be at most 10,000,000",)),
    ({"epochs": 1e5}, ("epochs must be at most 1,000",)),
    ({"learning_rate": math.nan}, ("learning_rate must be a finite number",)),
    ({"warmup_steps": 10**9}, ("warmup_steps must be at most",)),
    ({"grpo": {"temperature": 0}}, ("grpo.temperature must be in (0, 100]",)),
    ({"dataset_format": "xml"}, ("dataset_format must be one of auto, messages",)),
    ({"grpo": {"rewards": [{"name": "exactly"}]}}, ("unknown reward 'exactly'; valid names: exact_answer",)),
    ({"grpo": {"rewards": [{"name": "format_regex", "pattern": "(unclosed"}]}}, ("not a valid regex",)),
    ({"grpo": {"rewards": [{"name": "format_regex"}]}}, ("format_regex needs `pattern`",)),
    ({"grpo": {"rewards": [{"name": "length_penalty", "target_length": 0}]}}, ("length_penalty needs",)),
    ({"name": "n" * 241}, ("name is 241 characters long; at most 100",)),
    ({"name": "../escape"}, ("name must not contain /",)),
    ({"name": "line\nbreak"}, ("control characters",)),
    ({"gradient_checkpointing": "yes"}, ("gradient_checkpointing must be one of auto, off, standard, offload",)),
])
def test_absurd_values_are_refused_naming_the_field(data: dict, needles: tuple[str, ...]) -> None:
    _refused(data, *needles)


def test_unquoted_yaml_booleans_for_text_fields(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("gradient_checkpointing: off\nperformance: {cuda_graphs: off}\n")
    cfg = load_config(path)
    assert (cfg.gradient_checkpointing, cfg.performance.cuda_graphs) == ("off", "off")
    path.write_text("gradient_checkpointing: on\nperformance: {cuda_graphs: on}\n")
    cfg = load_config(path)
    assert (cfg.gradient_checkpointing, cfg.performance.cuda_graphs) == ("standard", "on")
    assert load_config(None, ["--gradient_checkpointing", "false"]).gradient_checkpointing == "off"
    _refused({"packing": "off"}, "packing must be true or false")  # a bool field takes no text


def test_numbers_as_yaml_users_write_them(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 2e-4\nmax_steps: 1e3\nepochs: 2\nlora: {alpha: 16.0}\n")
    cfg = load_config(path)
    assert (cfg.learning_rate, cfg.max_steps, cfg.epochs, cfg.lora.alpha) == (2e-4, 1000, 2.0, 16)
    assert isinstance(cfg.max_steps, int) and isinstance(cfg.epochs, float)
    _refused({"batch_size": 2.5}, "batch_size must be a whole number, got 2.5")


def test_overrides_go_through_the_same_checks() -> None:
    assert parse_overrides(["--lora.targets", "q_proj"]) == {"lora": {"targets": "q_proj"}}
    with pytest.raises(ConfigError, match="the value of '--lora.targets'.*aliases"):
        parse_overrides(["--lora.targets", alias_bomb()])
    with pytest.raises(ConfigError, match="names no key"):
        parse_overrides(["--lora.", "1"])
    with pytest.raises(ConfigError, match="lora was given a value already"):
        parse_overrides(["--lora", "1", "--lora.r", "8"])
    with pytest.raises(ConfigError, match="seed must be 0"):
        load_config(None, ["--seed", str(2**40)])


def test_shared_name_lists_match_the_engine() -> None:
    """The config checks names without importing the engine; they must be the engine's names."""
    from kestrel.data import FORMATS
    from kestrel.training.grpo.rewards import BUILTINS

    assert set(DATASET_FORMATS) == {"auto", *FORMATS} and REWARD_NAMES == BUILTINS


# --- 30.11: a long run name in the studio ---------------------------------------------------------


def test_long_run_names_in_the_studio(tmp_path: Path) -> None:
    from kestrel.studio.handlers import train
    from tests.studio.helpers import form

    extra, values = form(name="r" * 300)
    assert "name is 300 characters long" in train.preview(extra, *values)["status"]
    cfg = config_from_dict({"name": "r" * 100})
    cfg.name = "r" * 300  # even past the config's limit, the download's file name stays short
    assert len(Path(train._yaml_file(cfg, cfg.to_yaml())).name) < 120


# --- 30.5: a non-finite loss stops the run `failed` -----------------------------------------------


def test_a_non_finite_loss_stops_training_failed(tiny_model_dir, tmp_path: Path) -> None:
    from kestrel.training.run import run

    cfg = config_from_dict(dict(model=str(tiny_model_dir("llama")), dataset="arithmetic_chat",
                                output_dir=str(tmp_path / "run"), max_seq_length=64, batch_size=2, max_steps=5,
                                learning_rate=1e-3, save_steps=0, seed=0, gradient_checkpointing="off",
                                method="full"))
    cfg.weight_decay = math.inf  # what `weight_decay: .inf` did before the config refused it
    result = run(cfg)
    assert result.status == "failed" and result.step < 5, result
    assert "training stopped at step 2" in result.error and "learning_rate" in result.error
    assert "weight_decay (now inf)" in result.error
    assert not (tmp_path / "run" / "model").exists()  # no NaN model saved as a result


def test_an_infinite_reward_weight_stops_grpo_failed(tiny_model_dir, tmp_path: Path) -> None:
    from kestrel.training.run import run

    cfg = config_from_dict(dict(model=str(tiny_model_dir("llama")), method="grpo", dataset="arithmetic_prompts",
                                output_dir=str(tmp_path / "grpo"), max_seq_length=256, batch_size=2, max_steps=3,
                                save_steps=0, seed=0, gradient_checkpointing="off", dtype="fp32",
                                grpo=dict(num_generations=2, max_completion_length=4, max_prompt_length=48,
                                          rewards=[{"name": "format_regex", "pattern": "[0-9]"}])))
    cfg.grpo.rewards[0].weight = math.inf  # what `weight: .inf` did before the config refused it
    result = run(cfg)
    assert result.status == "failed" and "training stopped at step 1" in result.error, result
    assert "grpo.beta" in result.error and "reward weights" in result.error
    assert not (tmp_path / "grpo" / "adapter").exists()
