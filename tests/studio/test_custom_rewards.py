"""Custom reward code in the studio (issue 30, item 7): only whoever started the studio can allow
it (`--allow-custom-rewards`, kept in `StudioSettings` and passed down); no form value, YAML key or
state a browser sends turns it on; uploads are data files only."""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import pytest

from kestrel import jobs
from kestrel.studio import files, launch
from kestrel.studio.form import FORM_KEYS
from kestrel.studio.handlers import datasets as ds
from kestrel.studio.handlers import train
from kestrel.studio.settings import StudioSettings
from tests.studio.helpers import error_text, form

CUSTOM_YAML = """method: grpo
dataset: arithmetic_prompts
max_steps: 2
grpo:
  allow_custom_rewards: true
  rewards: [{{name: custom, path: {path}}}]
"""


def _reward(tmp_path: Path) -> Path:
    path = tmp_path / "reward.py"
    path.write_text("def reward(prompts, completions, answers):\n    return [1.0] * len(completions)\n")
    return path


def test_the_form_has_no_opt_in_box() -> None:
    assert "grpo.allow_custom_rewards" not in FORM_KEYS
    assert "grpo" not in train.default_form()["extra"] or "allow_custom_rewards" not in train.default_form()["extra"]["grpo"]


def test_a_remote_user_cannot_turn_custom_code_on(tmp_path: Path) -> None:
    """The YAML box, a loaded YAML file and the form's hidden state all say `allow_custom_rewards:
    true`; the studio was started without the flag, so each is refused, naming the flag."""
    text = CUSTOM_YAML.format(path=_reward(tmp_path))
    with pytest.raises(gr.Error) as excinfo:
        train.apply_yaml(text)
    assert "--allow-custom-rewards" in error_text(excinfo)
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(gr.Error) as excinfo:
        train.load_yaml_file(str(tmp_path / "run.yaml"))
    assert "--allow-custom-rewards" in error_text(excinfo)
    extra, values = form(method="grpo", dataset="arithmetic_prompts",
                         **{"grpo__rewards": [["custom", 1, "", "", str(tmp_path / "reward.py")]]})
    extra["grpo"] = {"allow_custom_rewards": True}  # a crafted request may carry any state
    with pytest.raises(gr.Error) as excinfo:
        train.start_training(extra, *values)
    assert "custom reward code is off in this studio" in error_text(excinfo)
    assert jobs.list_jobs() == []


def test_a_yaml_opt_in_is_ignored_without_a_custom_reward() -> None:
    filled = train.apply_yaml("method: grpo\ndataset: arithmetic_prompts\ngrpo: {allow_custom_rewards: true}\n")
    assert "allow_custom_rewards: false" in filled["yaml"]
    assert "allow_custom_rewards" not in filled["extra"].get("grpo", {})


def test_the_owner_flag_allows_it(tmp_path: Path, fake_engine: None) -> None:
    text = CUSTOM_YAML.format(path=_reward(tmp_path)).replace("allow_custom_rewards: true", "allow_custom_rewards: false")
    filled = train.apply_yaml(text, allow_custom=True)
    assert "allow_custom_rewards: true" in filled["yaml"]
    out = train.start_training(filled["extra"], *[filled[k] for k in FORM_KEYS], allow_custom=True)
    assert jobs.get_job(out["job"]).config["grpo"]["allow_custom_rewards"] is True


def test_the_flag_comes_from_the_command_line() -> None:
    assert launch.studio_settings(launch.parse_args([])) == StudioSettings()
    assert launch.studio_settings(launch.parse_args(["--allow-custom-rewards"])).allow_custom_rewards


def test_the_train_tab_shows_the_setting_read_only() -> None:
    from kestrel.studio.interface import build_app

    for allowed, words in ((False, "Custom reward code: **off**"), (True, "Custom reward code: **allowed**")):
        config = build_app(StudioSettings(allow_custom_rewards=allowed)).get_config_file()
        shown = [c["props"] for c in config["components"] if c["props"].get("elem_id") == "tr-custom-rewards"]
        assert len(shown) == 1 and words in shown[0]["value"]
        assert not [c for c in config["components"] if "allow-custom" in str(c["props"].get("elem_id"))
                    and c.get("type") == "checkbox"]


@pytest.mark.parametrize("name", ["reward.py", "run.sh", "model.bin", "notes.yaml"])
def test_uploads_are_data_files_only(kestrel_home: Path, name: str) -> None:
    """A refused upload names the allowed types, stores nothing, and Gradio's cached copy goes too."""
    cached = files.gradio_tmp_dir() / "abc123" / name
    cached.parent.mkdir(parents=True)
    cached.write_text("import os\nos.system('id')\n")
    with pytest.raises(gr.Error) as excinfo:
        ds.upload_dataset(str(cached), max_mb=10)
    assert name in error_text(excinfo) and ".jsonl" in error_text(excinfo)
    assert not cached.exists() and list(files.datasets_dir().iterdir()) == []


def test_the_yaml_button_reads_yaml_only(tmp_path: Path) -> None:
    path = tmp_path / "reward.py"
    path.write_text("model: demo\n")
    with pytest.raises(gr.Error) as excinfo:
        train.load_yaml_file(str(path))
    assert "reward.py: unsupported file type" in error_text(excinfo)
