"""The training config: one typed dataclass that the YAML file, the command line, the job store
and the studio all share.

    cfg = load_config("run.yaml", overrides=["--lora.r", "8", "--max_steps", "30"])
    cfg.to_yaml()  # the resolved config, as written to output_dir/config.yaml

An unknown key is an error that names it and lists the valid ones; every value is checked for
its kind (`build_checked`: list items and mapping values too, numbers finite and within SQLite's
64-bit integers) and then for its range in `__post_init__`, so a bad config fails, naming the
field, before anything is stored or any model is loaded. YAML text is read by
`kestrel.safe_yaml` (size, depth and alias-expansion limits). What needs the file system (the
output folder, the dataset, the model) is checked when a run is submitted (`check_output_dir`
here, `kestrel.jobs.preflight`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from kestrel.config_devices import check_devices_setting
from kestrel.config_evaluation import EarlyStoppingSettings, check_evaluation
from kestrel.constants import (
    DATASET_FORMATS, DPO_LOSS_TYPES, GRPO_LOSS_TYPES, PREFERENCE_FINETUNE, PREFERENCE_METHODS, REWARD_NAMES, merge,
)
from kestrel.errors import ConfigError
from kestrel.paths import expand_home
from kestrel.recompute.graph_choice import GRAPH_MODES
from kestrel.safe_yaml import parse_value, read_config_file

METHODS = ("qlora", "lora", "full", "grpo", *PREFERENCE_METHODS)
CHECKPOINTING = ("off", "standard", "offload")
SCHEDULERS = ("cosine", "linear", "constant")
DTYPES = ("auto", "bf16", "fp16", "fp32")
LOSS_TYPES = GRPO_LOSS_TYPES
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Bounds: far past any sane run, well inside what the job store (SQLite int64) and torch take.
INT64_MAX = 2**63 - 1
MAX_STEPS = 10_000_000
MAX_EPOCHS = 1_000
MAX_SEED = 2**32 - 1  # numpy's and CUDA's seeds are 32-bit
MAX_LORA_ALPHA = 8192
MAX_GENERATIONS = 1024
MAX_ITERATIONS = 100
MAX_TEXT = 65_536  # characters of any text value (a system prompt)
MAX_PATH = 1024  # characters of a path (output_dir, dataset, model)
MAX_NAME = 100  # characters of a run name (it names folders and files)
MAX_ITEMS = 100  # items of a list or mapping value (lora.targets, columns, grpo.rewards)
MAX_REWARD_WEIGHT = 1e6

# Text fields that YAML users write unquoted as booleans (`off` and `on` are YAML 1.1 booleans).
BOOLEAN_WORDS: dict[str, dict[bool, str]] = {
    "gradient_checkpointing": {False: "off", True: "standard"},
    "performance.cuda_graphs": {False: "off", True: "on"},
}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _show(value: Any) -> str:
    """A value for an error message: its repr, cut short (and safe for a 5,000-digit number)."""
    try:
        text = repr(value)
    except ValueError:  # int too large to print
        return "a number too large to print"
    return text if len(text) <= 80 else text[:77] + "..."


def _key_text(key: str) -> str:
    """A key as written when it is plain text, else its repr (cut short)."""
    return key if key.isprintable() and len(key) <= 80 else _show(key)


def _at_most(name: str, value: float | None, limit: float, unit: str = "") -> None:
    if value is not None and value > limit:
        raise ConfigError(f"{name} must be at most {limit:,}{unit}, got {_show(value)}")


def _check_path_text(name: str, text: str | None) -> None:
    """A path as text: no control characters, at most MAX_PATH characters, no part over 255 bytes
    (what file systems take). Whether it exists is checked when the run is submitted."""
    if text is None:
        return
    _check(not any(ord(c) < 32 for c in text), f"{name} must not contain control characters (a newline, a tab)")
    _check(len(text) <= MAX_PATH, f"{name} is {len(text):,} characters long; at most {MAX_PATH:,}")
    long_part = next((part for part in re.split(r"[/\\]", text) if len(part.encode("utf-8", "replace")) > 255), None)
    _check(long_part is None, f"{name} has a part over 255 bytes ({_show(long_part)}); file systems refuse it")


@dataclass
class LoraSettings:
    """LoRA adapter shape (ignored for full fine-tuning)."""

    r: int = 16  # rank: higher learns more and costs more memory
    alpha: int = 32  # scaling = alpha / r
    dropout: float = 0.0  # > 0 turns off the fused LoRA kernels (PEFT's path runs instead)
    # Module names; a single text is one name (`q_proj`), or several separated by commas.
    targets: list[str] = field(default_factory=lambda: list(ALL_LINEAR))
    # Start from a trained adapter (a PEFT folder, or a run folder holding adapter/): e.g. GRPO
    # after a LoRA SFT. Its own r/alpha/targets apply; the settings above are then ignored.
    init_from: str | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.r, int) and 1 <= self.r <= 1024, f"lora.r must be 1..1024, got {self.r}")
        _check(self.alpha > 0, f"lora.alpha must be positive, got {self.alpha}")
        _at_most("lora.alpha", self.alpha, MAX_LORA_ALPHA, " (the LoRA scale is alpha / r)")
        _check(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1), got {self.dropout}")
        _check(bool(self.targets), "lora.targets must name at least one module, e.g. q_proj")
        _check(all(isinstance(t, str) and t.strip() for t in self.targets),
               "lora.targets must be module names such as q_proj, not empty text")
        _check_path_text("lora.init_from", self.init_from)


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
        _check(2 <= self.num_generations <= MAX_GENERATIONS,
               f"grpo.num_generations must be 2..{MAX_GENERATIONS}, got {_show(self.num_generations)}")
        _check(1 <= self.num_iterations <= MAX_ITERATIONS,
               f"grpo.num_iterations must be 1..{MAX_ITERATIONS}, got {_show(self.num_iterations)}")
        _check(1 <= self.max_completion_length <= 1_048_576, "grpo.max_completion_length must be 1..1048576")
        _check(1 <= self.max_prompt_length <= 1_048_576, "grpo.max_prompt_length must be 1..1048576")
        _check(self.loss_type in LOSS_TYPES, f"grpo.loss_type must be one of {', '.join(LOSS_TYPES)}")
        _check(self.beta >= 0 and self.epsilon > 0, "grpo.beta must be >= 0 and grpo.epsilon > 0")
        _at_most("grpo.beta", self.beta, 1000.0)
        _at_most("grpo.epsilon", self.epsilon, 100.0)
        _check(0 < self.temperature <= 100, f"grpo.temperature must be in (0, 100], got {_show(self.temperature)}")
        _check(0 < self.top_p <= 1, f"grpo.top_p must be in (0, 1], got {_show(self.top_p)}")
        _check(bool(self.rewards), "grpo.rewards must list at least one reward")
        for spec in self.rewards:  # refused when the run is configured, not minutes later in the job
            _check(spec.name != "custom" or self.allow_custom_rewards, custom_reward_refusal(spec.path))
            check_reward(spec)


def check_reward(spec: RewardSpec) -> None:
    """A reward's name, weight and settings, as `kestrel.training.grpo.rewards` will need them."""
    _check(spec.name in REWARD_NAMES,
           f"grpo.rewards: unknown reward {spec.name!r}; valid names: {', '.join(REWARD_NAMES)}")
    _check(abs(spec.weight) <= MAX_REWARD_WEIGHT,
           f"grpo.rewards {spec.name}: weight must be within ±{MAX_REWARD_WEIGHT:g}, got {_show(spec.weight)}")
    if spec.name == "format_regex":
        _check(bool(spec.pattern), "grpo.rewards format_regex needs `pattern`, e.g. '<answer>.*</answer>'")
        try:
            re.compile(str(spec.pattern), re.DOTALL)
        except (re.error, OverflowError, RecursionError) as exc:
            raise ConfigError(f"grpo.rewards format_regex: pattern {_show(spec.pattern)} is not a valid regex "
                              f"({exc})") from None
    if spec.name == "length_penalty":
        _check(spec.target_length is not None and 1 <= spec.target_length <= 1_048_576,
               "grpo.rewards length_penalty needs `target_length`, a positive number of tokens (at most 1048576)")
    if spec.name == "custom":
        _check(bool(spec.path), "grpo.rewards: a custom reward needs `path`, a Python file defining reward(...)")
        _check_path_text("grpo.rewards path", spec.path)


def custom_reward_refusal(path: str | None) -> str:
    """Why a custom reward is refused without `grpo.allow_custom_rewards: true`."""
    return (f"grpo.rewards: the custom reward {path!r} is Python code that would run inside the training "
            "process with your permissions. Set `grpo.allow_custom_rewards: true` to allow it.")


@dataclass
class PreferenceSettings:
    """Preference training (method: dpo | orpo | kto | simpo). Names as TRL's configs spell them.

    The reference policy (DPO, KTO) is the base with the adapter disabled: no second copy of the
    weights. Full fine-tuning has no adapter to disable, so its reference log-probs are always
    computed once before training (`precompute_ref_logps` is then implied)."""

    finetune: str = "lora"  # lora | qlora (NF4 base) | full (every weight)
    # dpo, kto: temperature of the implicit reward beta * log(pi / ref); higher stays nearer the
    # reference. orpo: the weight of the odds-ratio term (the paper's lambda). simpo: reward scale.
    beta: float = 0.1
    loss_type: str = "sigmoid"  # dpo only: sigmoid (DPO) | ipo (IPO, per-token log-ratios) | hinge (SLiC)
    simpo_gamma: float = 0.5  # simpo: the target reward margin gamma
    cpo_alpha: float = 0.0  # simpo: weight of an NLL term on the chosen answers (0 = pure SimPO)
    desirable_weight: float = 1.0  # kto: weight of the losses of rows labelled desirable
    undesirable_weight: float = 1.0  # kto: weight of the losses of rows labelled undesirable
    # dpo, kto: reference log-probs computed once over the dataset before training (one extra
    # no-grad pass up front instead of one per step); always on with finetune: full.
    precompute_ref_logps: bool = False

    def __post_init__(self) -> None:
        _check(self.finetune in PREFERENCE_FINETUNE,
               f"preference.finetune must be one of {', '.join(PREFERENCE_FINETUNE)}, got {_show(self.finetune)}")
        _check(self.loss_type in DPO_LOSS_TYPES,
               f"preference.loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {_show(self.loss_type)}")
        _check(0 < self.beta <= 1000, f"preference.beta must be in (0, 1000], got {_show(self.beta)}")
        _check(0 <= self.simpo_gamma <= 100, f"preference.simpo_gamma must be 0..100, got {_show(self.simpo_gamma)}")
        _check(0 <= self.cpo_alpha <= 100, f"preference.cpo_alpha must be 0..100, got {_show(self.cpo_alpha)}")
        for name in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, name)
            _check(0 < value <= 1000, f"preference.{name} must be in (0, 1000], got {_show(value)}")


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
    method: str = "lora"  # qlora | lora | full | grpo | dpo | orpo | kto | simpo
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
    # 1, a count N (N GPUs, or N CPU processes without a GPU), auto (every visible GPU) or a list
    # of GPU ids: one run, data parallel across them (kestrel.training.distributed)
    devices: int | str | list[int] = 1
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
    preference: PreferenceSettings = field(default_factory=PreferenceSettings)
    performance: PerformanceSettings = field(default_factory=PerformanceSettings)
    # evaluation (kestrel.config_evaluation): a held-out file or a seeded fraction of `dataset`
    eval_dataset: str | None = None
    eval_split: float = 0.0  # 0 = no split
    eval_steps: int | None = None  # null: evaluation costs at most 5% of the training tokens
    early_stopping: EarlyStoppingSettings = field(default_factory=EarlyStoppingSettings)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])  # tensorboard | wandb | mlflow

    def __post_init__(self) -> None:
        # `$KESTREL_HOME/...` paths (the shipped configs use them) become real paths once, here
        for name in ("model", "dataset", "output_dir"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, expand_home(getattr(self, name)))
        if isinstance(self.lora.init_from, str):
            self.lora.init_from = expand_home(self.lora.init_from)
        _check(self.method in METHODS, f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _check(self.gradient_checkpointing in CHECKPOINTING,
               f"gradient_checkpointing must be one of {', '.join(CHECKPOINTING)}, got {self.gradient_checkpointing!r}")
        _check(self.lr_scheduler in SCHEDULERS, f"lr_scheduler must be one of {', '.join(SCHEDULERS)}")
        _check(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(self.dataset_format in DATASET_FORMATS,
               f"dataset_format must be one of {', '.join(DATASET_FORMATS)}, got {_show(self.dataset_format)}")
        self._check_numbers()
        self._check_texts()
        check_devices_setting(self)
        check_evaluation(self)

    def _check_numbers(self) -> None:
        """Steps, epochs, lengths, rates and the seed within sane ranges, naming the field."""
        _check(16 <= self.max_seq_length <= 1_048_576, f"max_seq_length must be 16..1048576, got {self.max_seq_length}")
        _check(self.max_steps is None or self.max_steps >= 1, f"max_steps must be at least 1, got {self.max_steps}")
        _at_most("max_steps", self.max_steps, MAX_STEPS)
        _check(self.epochs is None or self.epochs > 0, f"epochs must be positive, got {self.epochs}")
        _at_most("epochs", self.epochs, MAX_EPOCHS)
        _check(0 < self.learning_rate < 1, f"learning_rate must be in (0, 1), got {self.learning_rate}")
        _check(1 <= self.batch_size <= 4096, f"batch_size must be 1..4096, got {self.batch_size}")
        _check(1 <= self.grad_accum <= 4096, f"grad_accum must be 1..4096, got {self.grad_accum}")
        _check(self.save_steps >= 0, f"save_steps must be >= 0, got {self.save_steps}")
        _check(self.warmup_steps >= 0 and self.weight_decay >= 0, "warmup_steps and weight_decay must be >= 0")
        for name in ("save_steps", "warmup_steps", "logging_steps"):
            _at_most(name, getattr(self, name), MAX_STEPS)
        _at_most("weight_decay", self.weight_decay, 10.0, " (AdamW's decay per step is learning_rate x weight_decay)")
        _check(self.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 turns clipping off)")
        _at_most("max_grad_norm", self.max_grad_norm, 1e6, " (0 turns clipping off)")
        _check(self.logging_steps >= 1, "logging_steps must be at least 1")
        _check(0 <= self.seed <= MAX_SEED, f"seed must be 0..{MAX_SEED} (2**32 - 1), got {_show(self.seed)}")

    def _check_texts(self) -> None:
        """Names and paths: present where needed, free of control characters, not too long."""
        _check(bool(str(self.model).strip()), "model must name a hub id, a local folder or `demo`")
        _check(bool(str(self.dataset).strip()), "dataset must name a file or a sample dataset")
        for name in ("model", "dataset", "output_dir", "eval_dataset"):
            _check_path_text(name, getattr(self, name))
        if self.name is not None:
            _check(bool(self.name.strip()) and self.name.strip() not in (".", ".."),
                   "name must be a run name such as my-run (or left out for one made from the model)")
            _check(len(self.name) <= MAX_NAME, f"name is {len(self.name)} characters long; at most {MAX_NAME}")
            _check(not any(ord(c) < 32 or c in "/\\" for c in self.name),
                   f"name must not contain / or \\ or control characters, got {_show(self.name)}")
        _check(all(isinstance(v, str) and v.strip() for v in self.columns.values()),
               "columns must map each role to a column name (text), e.g. {prompt: question}")

    @property
    def is_preference(self) -> bool:
        return self.method in PREFERENCE_METHODS

    @property
    def load_in_4bit(self) -> bool:
        preference_nf4 = self.is_preference and self.preference.finetune == "qlora"
        return self.method == "qlora" or (self.method == "grpo" and self.grpo.load_in_4bit) or preference_nf4

    @property
    def trains_all_weights(self) -> bool:
        """Every weight trained (no adapter): `full`, or a preference method with finetune: full."""
        return self.method == "full" or (self.is_preference and self.preference.finetune == "full")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())


def build_checked(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a mapping, naming any unknown key and listing the valid ones.

    Every value is checked for its field's kind first (`checked_value`), so a wrong type is an
    error naming the key rather than a bare comparison error from the range checks."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping of keys to values, got {type(data).__name__}")
    odd = next((k for k in data if not isinstance(k, str)), None)
    if odd is not None:
        raise ConfigError(f"{where or 'config'}: keys must be text, got {_show(odd)}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key {prefix}{_key_text(unknown[0])}; valid keys{' under ' + where if where else ''}: "
            + ", ".join(sorted(names))
        )
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        nested, dotted = hints[key], f"{where}.{key}".strip(".")
        if dataclasses.is_dataclass(nested) and isinstance(nested, type):
            value = value if isinstance(value, nested) else build_checked(nested, value, dotted)
        else:
            if isinstance(value, bool) and dotted in BOOLEAN_WORDS:  # `gradient_checkpointing: off`
                value = BOOLEAN_WORDS[dotted][value]
            value = checked_value(dotted, nested, value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from exc


_SCALARS = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}


def _as_scalar(kind: type, value: Any) -> tuple[bool, Any]:
    """Whether `value` is of scalar `kind`, and the value as that kind: a whole float is an int
    (`max_steps: 1e3`), an int is a float; a bool is neither."""
    if isinstance(value, bool) or kind is bool:
        return kind is bool and isinstance(value, bool), value
    if kind is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return True, int(value)
        return isinstance(value, int), value
    if kind is float and isinstance(value, (int, float)):
        try:
            return True, float(value)
        except OverflowError:  # an int past float's range
            return True, math.inf
    return isinstance(value, kind), value


def _within_limits(key: str, value: Any) -> Any:
    """Numbers finite and within SQLite's int64, text free of NUL and at most MAX_TEXT long."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigError(f"{key} is out of range: {_show(value)} does not fit in 64 bits")
    if isinstance(value, str):
        _check("\x00" not in value, f"{key} must not contain NUL characters")
        _check(len(value) <= MAX_TEXT, f"{key} is {len(value):,} characters long; at most {MAX_TEXT:,}")
    return value


def checked_value(key: str, hint: Any, value: Any) -> Any:
    """`value` checked against field type `hint` and returned in that type, or a ConfigError that
    names `key`: scalars (see `_as_scalar`), optional ones, lists (each item) and mappings (each
    key and value). Kinds it does not know (a nested dataclass in a list) are left to the field."""
    origin = typing.get_origin(hint)
    if origin is list:
        return _checked_list(key, typing.get_args(hint)[0], value)
    if origin is dict:
        return _checked_mapping(key, typing.get_args(hint)[1], value)
    args = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    options = [a for a in args if a is not type(None)]
    if value is None and len(options) < len(args):
        return None
    if not options or any(t not in _SCALARS for t in options):
        return value
    for kind in options:
        ok, converted = _as_scalar(kind, value)
        if ok:
            return _within_limits(key, converted)
    raise ConfigError(f"{key} must be {' or '.join(_SCALARS[t] for t in options)}, got {_show(value)}")


def _checked_list(key: str, item: Any, value: Any) -> list[Any]:
    """A list value: a single text for a list of text is split at commas (`q_proj` or
    `q_proj, v_proj`), never into characters; each item checked and named by its index."""
    if isinstance(value, str) and item is str:
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list):
        raise ConfigError(f"{key} must be a list, got {_show(value)}")
    _check(len(value) <= MAX_ITEMS, f"{key} has {len(value):,} items; at most {MAX_ITEMS}")
    if dataclasses.is_dataclass(item):
        return list(value)  # built and checked by the section that holds it (grpo.rewards)
    return [checked_value(f"{key}[{i}]", item, v) for i, v in enumerate(value)]


def _checked_mapping(key: str, item: Any, value: Any) -> dict[str, Any]:
    """A mapping value (`columns`): text keys, each value checked and named by its key."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping (role: column name), got {_show(value)}")
    _check(len(value) <= MAX_ITEMS, f"{key} has {len(value):,} entries; at most {MAX_ITEMS}")
    odd = next((k for k in value if not isinstance(k, str)), None)
    if odd is not None:
        raise ConfigError(f"{key}: keys must be text, got {_show(odd)}")
    return {k: checked_value(f"{key}.{k}", item, v) for k, v in value.items()}


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
            raise ConfigError(f"overrides must be --key value pairs; could not read {_show(' '.join(args[i:]))}")
        value = _coerce_number(parse_value(args[i + 1], f"the value of {_show(key)}"))
        node = out
        parts = key[2:].replace("-", "_").split(".")
        _check(all(parts), f"override {_show(key)} names no key; write --key value or --section.key value")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            _check(isinstance(node, dict), f"override {_show(key)}: {part} was given a value already")
        node[parts[-1]] = value
        i += 2
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or start from defaults when `path` is None) and apply overrides."""
    data = read_config_file(path) if path is not None else {}
    return config_from_dict(merge(data, parse_overrides(overrides or [])))


def expand_path(text: str, name: str) -> Path:
    """`~`-expanded path, or a ConfigError naming the field (`~nobody/x`, a NUL)."""
    try:
        return Path(text).expanduser()
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"{name} {_show(text)} cannot be used: {exc}") from None


def check_output_dir(text: str, name: str = "output_dir") -> Path:
    """The output folder as an absolute path, once it is sure it can be used: not a file or a
    device, and either an existing folder we may write in, or creatable (its nearest existing
    parent is a folder we may write in). Nothing is created."""
    _check_path_text(name, text)
    path = expand_path(text, name)
    try:
        path = path.resolve()
        existing = path
        while not existing.exists():
            existing = existing.parent
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{name} {_show(text)} cannot be used: {getattr(exc, 'strerror', None) or exc}") from None
    if existing == path and not path.is_dir():
        raise ConfigError(f"{name} {path} is a file (or a device), not a folder; choose a folder to write the run into")
    if not existing.is_dir():
        raise ConfigError(f"{name} {path} cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} {path} cannot be created: no permission to write in {existing}")
    return path
