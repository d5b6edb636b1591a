"""The run's performance switches: typed config saved with the run, each with a debugging variable that
only overrides (`kestrel.env`), and both checked."""

from __future__ import annotations

from typing import Callable

import pytest

from kestrel.config import PerformanceSettings, config_from_dict
from kestrel.errors import ConfigError
from kestrel.recompute.capture_stream import capture_stream_mode
from kestrel.recompute.checkpoint import (
    backward_capture_mode, graph_mode, keep_attention_mode, keep_projection_mode, keep_qkv_mode,
)
from kestrel.recompute.mlp_deferral import defer_mode

SWITCHES = [  # field, default, the run's resolver, its variable, (configured: not the default, variable value, result)
    ("cuda_graphs", "auto", graph_mode, "KESTREL_CUDA_GRAPHS", ("off", "1", "on")),
    ("defer_mlp", "memory", defer_mode, "KESTREL_DEFER_MLP", ("fit", "off", "off")),
    ("keep_attention", "auto", keep_attention_mode, "KESTREL_KEEP_ATTENTION", ("off", "on", "on")),
    ("keep_projection", "on", keep_projection_mode, "KESTREL_KEEP_PROJECTION", ("off", "on", "on")),
    ("keep_qkv", "on", keep_qkv_mode, "KESTREL_KEEP_QKV", ("off", "on", "on")),
    ("backward_graph_capture", "first_pass", backward_capture_mode, "KESTREL_BACKWARD_CAPTURE",
     ("backward", "first_pass", "first_pass")),
    ("capture_stream", "steps", capture_stream_mode, "KESTREL_CAPTURE_STREAM", ("side", "steps", "steps")),
]


@pytest.mark.parametrize("field, default, resolve, variable, forced", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_a_switch_is_config_and_its_variable_only_overrides(
    field: str, default: str, resolve: Callable[[str], str], variable: str, forced: tuple[str, str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    configured, value, result = forced
    assert getattr(PerformanceSettings(), field) == default
    assert getattr(config_from_dict({"performance": {field: configured}}).performance, field) == configured
    assert configured != default
    with pytest.raises(ConfigError, match=f"performance.{field}"):
        config_from_dict({"performance": {field: "sometimes"}})
    with pytest.raises(ConfigError, match=f"performance.{field}"):
        PerformanceSettings(**{field: "sometimes"})
    monkeypatch.delenv(variable, raising=False)
    assert resolve(configured) == configured
    monkeypatch.setenv(variable, value)
    assert resolve(configured) == result
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ValueError, match=variable):
        resolve(configured)
