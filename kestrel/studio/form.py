"""The Train form described once: each field is a key of `kestrel.config.TrainConfig` (dotted for
nested settings), its kind and its section. The layout builds one widget per field from this
list, and the handlers turn widget values into a config dict and back with it, so the form and
the YAML file can never disagree about which settings exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel.config import ALL_LINEAR, CHECKPOINTING, DTYPES, LOSS_TYPES, SCHEDULERS
from kestrel.config_evaluation import REPORTERS
from kestrel.constants import DPO_LOSS_TYPES, PREFERENCE_FINETUNE


@dataclass(frozen=True)
class Field:
    key: str  # dotted TrainConfig key
    kind: str  # int | float | opt_int | opt_float | bool | choice | text | opt_text | multi | rewards | devices
    section: str  # main | advanced | evaluation | grpo | preference
    choices: tuple[str, ...] = ()
    step: float | None = None  # the Number widget's step


FIELDS: tuple[Field, ...] = (
    Field("max_seq_length", "int", "main", step=64),
    Field("max_steps", "opt_int", "main", step=1),
    Field("epochs", "opt_float", "main", step=0.5),
    Field("learning_rate", "float", "main"),
    Field("batch_size", "int", "main", step=1),
    Field("grad_accum", "int", "main", step=1),
    Field("lora.r", "int", "main", step=1),
    Field("lora.alpha", "int", "main", step=1),
    Field("gradient_checkpointing", "choice", "main", CHECKPOINTING),
    Field("name", "opt_text", "advanced"),
    Field("lora.dropout", "float", "advanced", step=0.05),
    Field("lora.targets", "multi", "advanced", tuple(ALL_LINEAR)),
    Field("lora.init_from", "opt_text", "advanced"),
    Field("packing", "bool", "advanced"),
    Field("train_on_responses_only", "bool", "advanced"),
    Field("save_steps", "int", "advanced", step=10),
    Field("seed", "int", "advanced", step=1),
    Field("devices", "devices", "advanced"),
    Field("dtype", "choice", "advanced", DTYPES),
    Field("warmup_steps", "int", "advanced", step=1),
    Field("lr_scheduler", "choice", "advanced", SCHEDULERS),
    Field("weight_decay", "float", "advanced", step=0.01),
    Field("max_grad_norm", "float", "advanced", step=0.1),
    Field("logging_steps", "int", "advanced", step=1),
    Field("dataset_format", "choice", "advanced",
          ("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text")),
    Field("system_prompt", "opt_text", "advanced"),
    Field("fast_kernels", "bool", "advanced"),
    Field("output_dir", "opt_text", "advanced"),
    Field("eval_split", "float", "evaluation", step=0.01),
    Field("eval_dataset", "opt_text", "evaluation"),
    Field("eval_steps", "opt_int", "evaluation", step=1),
    Field("early_stopping.patience", "int", "evaluation", step=1),
    Field("early_stopping.min_delta", "float", "evaluation", step=0.001),
    Field("report_to", "multi", "evaluation", REPORTERS),
    Field("grpo.num_generations", "int", "grpo", step=1),
    Field("grpo.max_completion_length", "int", "grpo", step=16),
    Field("grpo.max_prompt_length", "int", "grpo", step=16),
    Field("grpo.beta", "float", "grpo", step=0.01),
    Field("grpo.epsilon", "float", "grpo", step=0.05),
    Field("grpo.loss_type", "choice", "grpo", LOSS_TYPES),
    Field("grpo.temperature", "float", "grpo", step=0.1),
    Field("grpo.top_p", "float", "grpo", step=0.05),
    Field("grpo.rewards", "rewards", "grpo"),
    Field("preference.finetune", "choice", "preference", PREFERENCE_FINETUNE),
    Field("preference.beta", "float", "preference", step=0.05),
    Field("preference.loss_type", "choice", "preference", DPO_LOSS_TYPES),
    Field("preference.label_smoothing", "float", "preference", step=0.05),
    Field("preference.precompute_ref_logps", "bool", "preference"),
    Field("preference.simpo_gamma", "float", "preference", step=0.1),
    Field("preference.cpo_alpha", "float", "preference", step=0.1),
    Field("preference.desirable_weight", "float", "preference", step=0.1),
    Field("preference.undesirable_weight", "float", "preference", step=0.1),
)  # no widget for grpo.allow_custom_rewards: the studio's owner decides it (`--allow-custom-rewards`)

# The columns of the GRPO rewards table: one row per `kestrel.config.RewardSpec`.
REWARD_COLUMNS = ("name", "weight", "pattern", "target_length", "path")

# Widgets laid out by hand (they need more than one widget or dynamic choices), then the fields.
HEAD_KEYS = ("model_source", "model", "method", "dataset")
FORM_KEYS: tuple[str, ...] = HEAD_KEYS + tuple(f.key for f in FIELDS)
FIELD_BY_KEY = {f.key: f for f in FIELDS}
# Config keys whoever started the studio decides (`kestrel.studio.settings`): a form or YAML value is ignored.
OWNER_KEYS = ("grpo.allow_custom_rewards",)
# The sections whose settings the form names by dotted keys (`lora.r`); `columns` stays one value.
DOTTED_SECTIONS = ("lora", "grpo", "preference", "early_stopping")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config dict keyed the form's way: `{"lora": {"r": 8}}` -> `{"lora.r": 8}`."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in DOTTED_SECTIONS:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `value` at a dotted key (`lora.r`) of a nested config dict, making sections as needed."""
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value
