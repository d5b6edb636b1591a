"""The training config: one typed dataclass that the YAML file, the command line, the job store
and the studio all share.

    cfg = load_config("run.yaml", overrides=["--lora.r", "8", "--max_steps", "30"])
    cfg.to_yaml()  # the resolved config, as written to output_dir/config.yaml

An unknown key is an error that names it and lists the valid ones; values are checked in
`__post_init__` so a bad config fails before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from kestrel.constants import GRPO_LOSS_TYPES, merge
from kestrel.errors import ConfigError
from kestrel.recompute.graph_choice import GRAPH_MODES

METHODS = ("qlora", "lora", "full", "grpo")
CHECKPOINTING = ("off", "standard", "offload")
SCHEDULERS = ("cosine", "linear", "constant")
DTYPES = ("auto", "bf16", "fp16", "fp32")
LOSS_TYPES = GRPO_LOSS_TYPES
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass
class LoraSettings:
    """LoRA adapter shape (ignored for full fine-tuning)."""

    r: int = 16  # rank: higher learns more and costs more memory
    alpha: int = 32  # scaling = alpha / r
    dropout: float = 0.0  # > 0 turns off the fused LoRA kernels (PEFT's path runs instead)
    targets: list[str] = field(default_factory=lambda: list(ALL_LINEAR))
    # Start from a trained adapter (a PEFT folder, or a run folder holding adapter/): e.g. GRPO
    # after a LoRA SFT. Its own r/alpha/targets apply; the settings above are then ignored.
    init_from: str | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.r, int) and 1 <= self.r <= 1024, f"lora.r must be 1..1024, got {self.r}")
        _check(self.alpha > 0, f"lora.alpha must be positive, got {self.alpha}")
        _check(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1), got {self.dropout}")
        _check(bool(self.targets), "lora.targets must name at least one module, e.g. q_proj")


@dataclass
class RewardSpec:
    """One GRPO reward: a built-in `name` (or `custom` with `path`) and its weight."""

    name: str
    weight: float = 1.0
    pattern: str | None = None  # format_regex
    target_length: int | None = None  # length_penalty
    path: str | None = None  # custom: a Python file defining reward(prompts, completions, answers)


@dataclass
class GrpoSettings:
    """GRPO settings (method: grpo)."""

    num_generations: int = 8  # completions per prompt; advantages are normalised in each group
    max_completion_length: int = 256
    max_prompt_length: int = 512
    beta: float = 0.04  # KL weight to the reference (adapter disabled); 0 skips the reference pass
    epsilon: float = 0.2  # ratio clip
    loss_type: str = "grpo"  # grpo (sequence mean) | dapo | dr_grpo (token level)
    temperature: float = 1.0
    top_p: float = 1.0
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec(name="exact_answer")])
    allow_custom_rewards: bool = False  # custom reward files run inside the job's process
    num_iterations: int = 1  # policy updates per batch of rollouts (ratio clipping matters when > 1)
    load_in_4bit: bool = False  # NF4 base (QLoRA-style GRPO); needs CUDA

    def __post_init__(self) -> None:
        self.rewards = [r if isinstance(r, RewardSpec) else build_checked(RewardSpec, r, "grpo.rewards[]")
                        for r in self.rewards]
        _check(self.num_generations >= 2, f"grpo.num_generations must be at least 2, got {self.num_generations}")
        _check(self.max_completion_length >= 1, "grpo.max_completion_length must be positive")
        _check(self.loss_type in LOSS_TYPES, f"grpo.loss_type must be one of {', '.join(LOSS_TYPES)}")
        _check(self.beta >= 0 and self.epsilon > 0, "grpo.beta must be >= 0 and grpo.epsilon > 0")
        _check(self.temperature > 0, "grpo.temperature must be positive")
        _check(bool(self.rewards), "grpo.rewards must list at least one reward")
        for spec in self.rewards:  # refused when the run is configured, not minutes later in the job
            _check(spec.name != "custom" or self.allow_custom_rewards, custom_reward_refusal(spec.path))


def custom_reward_refusal(path: str | None) -> str:
    """Why a custom reward is refused without `grpo.allow_custom_rewards: true`."""
    return (f"grpo.rewards: the custom reward {path!r} is Python code that would run inside the training "
            "process with your permissions. Set `grpo.allow_custom_rewards: true` to allow it.")


@dataclass
class PerformanceSettings:
    """Speed switches, saved with each run so it can be reproduced. `auto` chooses by measuring
    on the run's own shapes; the choice made is written to the run's log and metrics."""

    # Decoder layers replayed as CUDA graphs (training with checkpointing, on CUDA): auto times
    # both ways on each batch layout and keeps the faster (`kestrel.recompute.graph_choice`); on | off force.
    cuda_graphs: str = "auto"
    # Offloaded checkpointing: the share of layers (0 to 1, spread evenly) whose MLP gate product
    # is also paged out to host memory, so the recompute skips its largest product.
    offload_gate: float = 1.0

    def __post_init__(self) -> None:
        _check(self.cuda_graphs in GRAPH_MODES,
               f"performance.cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {self.cuda_graphs!r}")
        _check(0.0 <= self.offload_gate <= 1.0, f"performance.offload_gate must be 0 to 1, got {self.offload_gate}")


@dataclass
class TrainConfig:
    """Everything one training run needs. The same fields are the YAML keys."""

    model: str = "demo"  # a hub id, a local folder, or `demo` (built in, offline)
    method: str = "lora"  # qlora | lora | full | grpo
    dataset: str = "arithmetic_chat"  # a file (jsonl, json, csv, parquet) or a shipped sample name
    output_dir: str | None = None  # default: KESTREL_HOME/runs/<name>
    name: str | None = None  # run name; default derived from model and time
    max_seq_length: int = 1024
    max_steps: int | None = None  # wins over epochs when both are set
    epochs: float | None = None  # default 1 when max_steps is not set
    learning_rate: float = 2e-4
    batch_size: int = 2
    grad_accum: int = 1
    lora: LoraSettings = field(default_factory=LoraSettings)
    packing: bool = False  # several samples per row, attention kept inside each sample
    train_on_responses_only: bool = True  # mask prompt tokens out of the loss
    # off | standard | offload (layer inputs and MLP gate products in CPU memory: the least GPU
    # memory, and on CUDA the fastest)
    gradient_checkpointing: str = "standard"
    save_steps: int = 100  # 0 saves only at the end
    seed: int = 42
    # advanced
    dtype: str = "auto"  # compute dtype: bf16 where supported, else fp32 on CPU
    warmup_steps: int = 0
    lr_scheduler: str = "cosine"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    logging_steps: int = 1
    dataset_format: str = "auto"  # or messages | sharegpt | alpaca | prompt_completion | text
    columns: dict[str, str] = field(default_factory=dict)  # role -> column name overrides
    system_prompt: str | None = None
    fast_kernels: bool = True  # false trains through the plain Hugging Face path (for comparison)
    grpo: GrpoSettings = field(default_factory=GrpoSettings)
    performance: PerformanceSettings = field(default_factory=PerformanceSettings)

    def __post_init__(self) -> None:
        _check(self.method in METHODS, f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _check(self.gradient_checkpointing in CHECKPOINTING,
               f"gradient_checkpointing must be one of {', '.join(CHECKPOINTING)}, got {self.gradient_checkpointing!r}")
        _check(self.lr_scheduler in SCHEDULERS, f"lr_scheduler must be one of {', '.join(SCHEDULERS)}")
        _check(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(16 <= self.max_seq_length <= 1_048_576, f"max_seq_length must be 16..1048576, got {self.max_seq_length}")
        _check(self.max_steps is None or self.max_steps >= 1, f"max_steps must be at least 1, got {self.max_steps}")
        _check(self.epochs is None or self.epochs > 0, f"epochs must be positive, got {self.epochs}")
        _check(0 < self.learning_rate < 1, f"learning_rate must be in (0, 1), got {self.learning_rate}")
        _check(1 <= self.batch_size <= 4096, f"batch_size must be 1..4096, got {self.batch_size}")
        _check(1 <= self.grad_accum <= 4096, f"grad_accum must be 1..4096, got {self.grad_accum}")
        _check(self.save_steps >= 0, f"save_steps must be >= 0, got {self.save_steps}")
        _check(self.warmup_steps >= 0 and self.weight_decay >= 0, "warmup_steps and weight_decay must be >= 0")
        _check(self.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 turns clipping off)")
        _check(self.logging_steps >= 1, "logging_steps must be at least 1")
        _check(bool(str(self.model).strip()), "model must name a hub id, a local folder or `demo`")
        _check(bool(str(self.dataset).strip()), "dataset must name a file or a sample dataset")

    @property
    def load_in_4bit(self) -> bool:
        return self.method == "qlora" or (self.method == "grpo" and self.grpo.load_in_4bit)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())


def build_checked(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a mapping, naming any unknown key and listing the valid ones."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping of keys to values, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}; valid keys{' under ' + where if where else ''}: "
            + ", ".join(sorted(names))
        )
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        nested = hints[key]
        if dataclasses.is_dataclass(nested) and isinstance(nested, type):
            value = value if isinstance(value, nested) else build_checked(nested, value, f"{where}.{key}".strip("."))
        else:
            _check_type(f"{where}.{key}".strip("."), nested, value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from exc


_SCALARS = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}


def _check_type(key: str, hint: Any, value: Any) -> None:
    """Refuse a value of the wrong kind for a scalar field, naming the key (`batch_size: many`)."""
    origin = typing.get_origin(hint)
    if origin is not None and origin not in (typing.Union, types.UnionType):
        return  # containers (list, dict) are checked by the field's own validation
    args = typing.get_args(hint) or (hint,)
    options = [a for a in args if a is not type(None)]
    if value is None and len(options) < len(args):
        return
    scalars = [t for t in options if t in _SCALARS]
    if not scalars or len(scalars) != len(options):
        return
    ok = any(
        isinstance(value, t) and not (t in (int, float) and isinstance(value, bool)) or (t is float and type(value) is int)
        for t in scalars
    )
    if not ok:
        raise ConfigError(f"{key} must be {' or '.join(_SCALARS[t] for t in scalars)}, got {value!r}")


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig from a plain mapping (a parsed YAML file, the studio's form)."""
    return build_checked(TrainConfig, data, "")


def _coerce_number(value: Any) -> Any:
    """YAML 1.1 reads `2e-3` as text; a command-line value that is a number becomes one."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                continue
    return value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["--lora.r", "8", "--packing", "true"]` -> `{"lora": {"r": 8}, "packing": True}`."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        key = args[i]
        if not key.startswith("--") or i + 1 >= len(args):
            raise ConfigError(f"overrides must be --key value pairs; could not read {' '.join(args[i:])!r}")
        value = _coerce_number(yaml.safe_load(args[i + 1]))
        node = out
        parts = key[2:].replace("-", "_").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        i += 2
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or start from defaults when `path` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
    return config_from_dict(merge(data, parse_overrides(overrides or [])))
