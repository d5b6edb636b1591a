"""The training config: one typed dataclass that the YAML file, the command line, the job store
and the studio all share.

    cfg = load_config("run.yaml", overrides=["--lora.r", "8", "--max_steps", "30"])
    cfg.to_yaml()  # the resolved config, as written to output_dir/config.yaml

An unknown key is an error that names it and lists the valid ones; every value is checked for
its kind (`kestrel.config_values.build_checked`: list items and mapping values too, numbers finite
and within SQLite's 64-bit integers) and then for its range in `__post_init__`, so a bad config
fails, naming the field, before anything is stored or any model is loaded. YAML text is read by
`kestrel.safe_yaml` (size, depth and alias-expansion limits). What needs the file system (the
output folder, the dataset, the model) is checked when a run is submitted (`check_output_dir`
here, `kestrel.jobs.preflight`). Sections kept apart: `config_preference`, `config_evaluation`,
`config_devices`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kestrel.config_devices import check_devices_setting
from kestrel.config_evaluation import EarlyStoppingSettings, check_evaluation
from kestrel.config_preference import PreferenceSettings
from kestrel.config_values import at_most, build_checked, check, check_path_text, show
from kestrel.constants import DATASET_FORMATS, GRPO_LOSS_TYPES, PREFERENCE_METHODS, REWARD_NAMES, merge
from kestrel.errors import ConfigError
from kestrel.paths import expand_home
from kestrel.recompute.graph_choice import GRAPH_MODES
from kestrel.constants import (
    BACKWARD_CAPTURE_MODES, CAPTURE_STREAMS, CUDA_ALLOCATORS, DEFER_MODES, KEEP_ATTENTION_MODES, KEEP_PROJECTION_MODES,
    KEEP_QKV_MODES,
)
from kestrel.safe_yaml import parse_value, read_config_file

METHODS = ("qlora", "lora", "full", "grpo", *PREFERENCE_METHODS)
CHECKPOINTING = ("auto", "off", "standard", "offload")
SCHEDULERS = ("cosine", "linear", "constant")
DTYPES = ("auto", "bf16", "fp16", "fp32")
LOSS_TYPES = GRPO_LOSS_TYPES
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Bounds: far past any sane run, well inside what the job store (SQLite int64) and torch take
# (the limits every value shares are in kestrel.config_values).
MAX_STEPS = 10_000_000
MAX_EPOCHS = 1_000
MAX_SEED = 2**32 - 1  # numpy's and CUDA's seeds are 32-bit
MAX_LORA_ALPHA = 8192
MAX_GENERATIONS = 1024
MAX_ITERATIONS = 100
MAX_NAME = 100  # characters of a run name (it names folders and files)
MAX_REWARD_WEIGHT = 1e6


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
        check(isinstance(self.r, int) and 1 <= self.r <= 1024, f"lora.r must be 1..1024, got {self.r}")
        check(self.alpha > 0, f"lora.alpha must be positive, got {self.alpha}")
        at_most("lora.alpha", self.alpha, MAX_LORA_ALPHA, " (the LoRA scale is alpha / r)")
        check(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1), got {self.dropout}")
        check(bool(self.targets), "lora.targets must name at least one module, e.g. q_proj")
        check(all(isinstance(t, str) and t.strip() for t in self.targets),
              "lora.targets must be module names such as q_proj, not empty text")
        check_path_text("lora.init_from", self.init_from)


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
        check(2 <= self.num_generations <= MAX_GENERATIONS,
              f"grpo.num_generations must be 2..{MAX_GENERATIONS}, got {show(self.num_generations)}")
        check(1 <= self.num_iterations <= MAX_ITERATIONS,
              f"grpo.num_iterations must be 1..{MAX_ITERATIONS}, got {show(self.num_iterations)}")
        check(1 <= self.max_completion_length <= 1_048_576, "grpo.max_completion_length must be 1..1048576")
        check(1 <= self.max_prompt_length <= 1_048_576, "grpo.max_prompt_length must be 1..1048576")
        check(self.loss_type in LOSS_TYPES, f"grpo.loss_type must be one of {', '.join(LOSS_TYPES)}")
        check(self.beta >= 0 and self.epsilon > 0, "grpo.beta must be >= 0 and grpo.epsilon > 0")
        at_most("grpo.beta", self.beta, 1000.0)
        at_most("grpo.epsilon", self.epsilon, 100.0)
        check(0 < self.temperature <= 100, f"grpo.temperature must be in (0, 100], got {show(self.temperature)}")
        check(0 < self.top_p <= 1, f"grpo.top_p must be in (0, 1], got {show(self.top_p)}")
        check(bool(self.rewards), "grpo.rewards must list at least one reward")
        for spec in self.rewards:  # refused when the run is configured, not minutes later in the job
            check(spec.name != "custom" or self.allow_custom_rewards, custom_reward_refusal(spec.path))
            check_reward(spec)


def check_reward(spec: RewardSpec) -> None:
    """A reward's name, weight and settings, as `kestrel.training.grpo.rewards` will need them."""
    check(spec.name in REWARD_NAMES,
          f"grpo.rewards: unknown reward {spec.name!r}; valid names: {', '.join(REWARD_NAMES)}")
    check(abs(spec.weight) <= MAX_REWARD_WEIGHT,
          f"grpo.rewards {spec.name}: weight must be within ±{MAX_REWARD_WEIGHT:g}, got {show(spec.weight)}")
    if spec.name == "format_regex":
        check(bool(spec.pattern), "grpo.rewards format_regex needs `pattern`, e.g. '<answer>.*</answer>'")
        try:
            re.compile(str(spec.pattern), re.DOTALL)
        except (re.error, OverflowError, RecursionError) as exc:
            raise ConfigError(f"grpo.rewards format_regex: pattern {show(spec.pattern)} is not a valid regex "
                              f"({exc})") from None
    if spec.name == "length_penalty":
        check(spec.target_length is not None and 1 <= spec.target_length <= 1_048_576,
              "grpo.rewards length_penalty needs `target_length`, a positive number of tokens (at most 1048576)")
    if spec.name == "custom":
        check(bool(spec.path), "grpo.rewards: a custom reward needs `path`, a Python file defining reward(...)")
        check_path_text("grpo.rewards path", spec.path)


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
    # Whether a checkpointed layer's recomputed MLP runs in its backward in chunks of rows (less memory
    # on long rows, but no paged gate product): memory wherever that lowers its peak; fit only where
    # whole rows would not fit the device or their paged gate products would not keep up with the layers
    # on the host link, both measured (faster, more memory); off never (`kestrel.recompute.mlp_deferral`).
    defer_mlp: str = "memory"
    # Offloaded checkpointing: each layer pages its causal attention's output and logsumexp out too, so
    # its recompute runs no attention forward (`kestrel.model.kept_attention`): on, off, or auto (rows at
    # least as long as the hidden size, where that pays more per byte paged than the gate product, and
    # only where the measured host link carries it within a layer's first pass, `kestrel.recompute.host_link`).
    keep_attention: str = "auto"
    # Where a layer keeps its attention output (keep_attention), it pages its output projection's output too
    # (hidden x 2 bytes a row more on the link), so the recompute skips that product as well (on | off); under
    # keep_attention auto, only where the measured link carries those bytes too (else the attention output alone).
    keep_projection: str = "on"
    # Where a layer keeps its attention output, it pages its Q, K and V projections' outputs too ((Hq + 2 Hkv) x
    # head_dim x 2 bytes a row), so the recompute runs none of their products either (on | off); under keep_attention
    # auto, only where the measured link carries them after the output projection's output.
    keep_qkv: str = "on"
    # How torch's CUDA caching allocator grows its segments: expandable (reserved memory follows what the run
    # holds) or fixed (torch's default); `kestrel.training.cuda_allocator`.
    cuda_allocator: str = "expandable"
    # When a CUDA-graphed layer's recompute-and-backward graph is captured, on its signature's second sighting:
    # first_pass (in that step's first pass, just before the first-pass graph, so the capture step runs no eager
    # first pass beside the graphs' pool) or backward (in that step's backward, after an eager first pass, whose
    # freed blocks the default pool holds beside the growing graph pool); `kestrel.recompute.layer_graphs`.
    # Layers tied to others (`kestrel.recompute.linked`) capture in the backward either way.
    backward_graph_capture: str = "first_pass"
    # Which stream the layer graphs are captured on: side (a stream of their own; the steps run on the default
    # stream) or steps (the run's steps run on a stream of their own and the graphs capture on it, so cuBLAS keeps
    # one workspace a handle instead of two and one stream's block cache serves both: the default since it measured
    # 0.08 GiB less reserved at the same speed, bench/RESULTS.md session 47); `kestrel.recompute.capture_stream`.
    capture_stream: str = "steps"

    def __post_init__(self) -> None:
        check(self.cuda_graphs in GRAPH_MODES,
              f"performance.cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {self.cuda_graphs!r}")
        check(0.0 <= self.offload_gate <= 1.0, f"performance.offload_gate must be 0 to 1, got {self.offload_gate}")
        check(self.keep_attention in KEEP_ATTENTION_MODES,
              f"performance.keep_attention must be one of {', '.join(KEEP_ATTENTION_MODES)}, got {self.keep_attention!r}")
        check(self.keep_projection in KEEP_PROJECTION_MODES,
              f"performance.keep_projection must be one of {', '.join(KEEP_PROJECTION_MODES)}, got {self.keep_projection!r}")
        check(self.keep_qkv in KEEP_QKV_MODES,
              f"performance.keep_qkv must be one of {', '.join(KEEP_QKV_MODES)}, got {self.keep_qkv!r}")
        check(self.cuda_allocator in CUDA_ALLOCATORS,
              f"performance.cuda_allocator must be one of {', '.join(CUDA_ALLOCATORS)}, got {self.cuda_allocator!r}")
        check(self.backward_graph_capture in BACKWARD_CAPTURE_MODES,
              "performance.backward_graph_capture must be one of "
              f"{', '.join(BACKWARD_CAPTURE_MODES)}, got {self.backward_graph_capture!r}")
        check(self.capture_stream in CAPTURE_STREAMS,
              f"performance.capture_stream must be one of {', '.join(CAPTURE_STREAMS)}, got {self.capture_stream!r}")
        check(self.defer_mlp in DEFER_MODES,
              f"performance.defer_mlp must be one of {', '.join(DEFER_MODES)}, got {self.defer_mlp!r}")


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
    # auto | off | standard | offload (layer inputs and MLP gate products in CPU memory: the least
    # GPU memory). auto: offload on one GPU where its pages fit the RAM, else standard
    # (`kestrel.recompute.policy`); the run's log and performance.json say which and why.
    gradient_checkpointing: str = "auto"
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
    eval_steps: int | None = None  # null: evaluation costs at most 5% of the training time (measured)
    early_stopping: EarlyStoppingSettings = field(default_factory=EarlyStoppingSettings)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])  # tensorboard | wandb | mlflow

    def __post_init__(self) -> None:
        # `$KESTREL_HOME/...` paths (the shipped configs use them) become real paths once, here
        for name in ("model", "dataset", "output_dir"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, expand_home(getattr(self, name)))
        if isinstance(self.lora.init_from, str):
            self.lora.init_from = expand_home(self.lora.init_from)
        check(self.method in METHODS, f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        check(self.gradient_checkpointing in CHECKPOINTING,
              f"gradient_checkpointing must be one of {', '.join(CHECKPOINTING)}, got {self.gradient_checkpointing!r}")
        check(self.lr_scheduler in SCHEDULERS, f"lr_scheduler must be one of {', '.join(SCHEDULERS)}")
        check(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check(self.dataset_format in DATASET_FORMATS,
              f"dataset_format must be one of {', '.join(DATASET_FORMATS)}, got {show(self.dataset_format)}")
        self._check_numbers()
        self._check_texts()
        check_devices_setting(self)
        check_evaluation(self)

    def _check_numbers(self) -> None:
        """Steps, epochs, lengths, rates and the seed within sane ranges, naming the field."""
        check(16 <= self.max_seq_length <= 1_048_576, f"max_seq_length must be 16..1048576, got {self.max_seq_length}")
        check(self.max_steps is None or self.max_steps >= 1, f"max_steps must be at least 1, got {self.max_steps}")
        at_most("max_steps", self.max_steps, MAX_STEPS)
        check(self.epochs is None or self.epochs > 0, f"epochs must be positive, got {self.epochs}")
        at_most("epochs", self.epochs, MAX_EPOCHS)
        check(0 < self.learning_rate < 1, f"learning_rate must be in (0, 1), got {self.learning_rate}")
        check(1 <= self.batch_size <= 4096, f"batch_size must be 1..4096, got {self.batch_size}")
        check(1 <= self.grad_accum <= 4096, f"grad_accum must be 1..4096, got {self.grad_accum}")
        check(self.save_steps >= 0, f"save_steps must be >= 0, got {self.save_steps}")
        check(self.warmup_steps >= 0 and self.weight_decay >= 0, "warmup_steps and weight_decay must be >= 0")
        for name in ("save_steps", "warmup_steps", "logging_steps"):
            at_most(name, getattr(self, name), MAX_STEPS)
        at_most("weight_decay", self.weight_decay, 10.0, " (AdamW's decay per step is learning_rate x weight_decay)")
        check(self.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 turns clipping off)")
        at_most("max_grad_norm", self.max_grad_norm, 1e6, " (0 turns clipping off)")
        check(self.logging_steps >= 1, "logging_steps must be at least 1")
        check(0 <= self.seed <= MAX_SEED, f"seed must be 0..{MAX_SEED} (2**32 - 1), got {show(self.seed)}")

    def _check_texts(self) -> None:
        """Names and paths: present where needed, free of control characters, not too long."""
        check(bool(str(self.model).strip()), "model must name a hub id, a local folder or `demo`")
        check(bool(str(self.dataset).strip()), "dataset must name a file or a sample dataset")
        for name in ("model", "dataset", "output_dir", "eval_dataset"):
            check_path_text(name, getattr(self, name))
        if self.name is not None:
            check(bool(self.name.strip()) and self.name.strip() not in (".", ".."),
                  "name must be a run name such as my-run (or left out for one made from the model)")
            check(len(self.name) <= MAX_NAME, f"name is {len(self.name)} characters long; at most {MAX_NAME}")
            check(not any(ord(c) < 32 or c in "/\\" for c in self.name),
                  f"name must not contain / or \\ or control characters, got {show(self.name)}")
        check(all(isinstance(v, str) and v.strip() for v in self.columns.values()),
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
            raise ConfigError(f"overrides must be --key value pairs; could not read {show(' '.join(args[i:]))}")
        value = _coerce_number(parse_value(args[i + 1], f"the value of {show(key)}"))
        node = out
        parts = key[2:].replace("-", "_").split(".")
        check(all(parts), f"override {show(key)} names no key; write --key value or --section.key value")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            check(isinstance(node, dict), f"override {show(key)}: {part} was given a value already")
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
        raise ConfigError(f"{name} {show(text)} cannot be used: {exc}") from None


def check_output_dir(text: str, name: str = "output_dir") -> Path:
    """The output folder as an absolute path, once it is sure it can be used: not a file or a
    device, and either an existing folder we may write in, or creatable (its nearest existing
    parent is a folder we may write in). Nothing is created."""
    check_path_text(name, text)
    path = expand_path(text, name)
    try:
        path = path.resolve()
        existing = path
        while not existing.exists():
            existing = existing.parent
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{name} {show(text)} cannot be used: {getattr(exc, 'strerror', None) or exc}") from None
    if existing == path and not path.is_dir():
        raise ConfigError(f"{name} {path} is a file (or a device), not a folder; choose a folder to write the run into")
    if not existing.is_dir():
        raise ConfigError(f"{name} {path} cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} {path} cannot be created: no permission to write in {existing}")
    return path
