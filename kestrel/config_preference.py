"""The preference part of the training config (method: dpo | orpo | kto | simpo): which weights
train and each loss's settings, as TRL's configs name them. `TrainConfig` holds the section as its
`preference` field; kept apart so config.py stays one screenful of fields. Torch-free.

    method: dpo
    preference: {finetune: lora, beta: 0.1, loss_type: sigmoid, precompute_ref_logps: false}
"""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.config_values import check, show
from kestrel.constants import DPO_LOSS_TYPES, PREFERENCE_FINETUNE, SHARE_PROMPT_MODES, SMOOTHED_LOSS_TYPES


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
    # dpo only: sigmoid (DPO) | ipo (IPO, per-token log-ratios) | hinge (SLiC) | robust | exo_pair |
    # nca_pair | bco_pair | sppo_hard | apo_zero | apo_down, as TRL names them
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0  # dpo robust / exo_pair: the assumed chance that a pair's labels are flipped
    simpo_gamma: float = 0.5  # simpo: the target reward margin gamma
    cpo_alpha: float = 0.0  # simpo: weight of an NLL term on the chosen answers (0 = pure SimPO)
    desirable_weight: float = 1.0  # kto: weight of the losses of rows labelled desirable
    undesirable_weight: float = 1.0  # kto: weight of the losses of rows labelled undesirable
    # dpo, kto: reference log-probs computed once over the dataset before training (one extra
    # no-grad pass up front instead of one per step); always on with finetune: full.
    precompute_ref_logps: bool = False
    # dpo, orpo, simpo: each pair as one sample [prompt, chosen, rejected] whose prompt is computed
    # once for both answers (on), or chosen and rejected as two whole sequences (off). auto: once
    # wherever the model can (varlen attention on CUDA in 16-bit; not linear attention, shared K/V
    # or attention sinks); the layout that ran is logged and recorded as the metric shared_prompt.
    share_prompt: str = "auto"

    def __post_init__(self) -> None:
        check(self.finetune in PREFERENCE_FINETUNE,
              f"preference.finetune must be one of {', '.join(PREFERENCE_FINETUNE)}, got {show(self.finetune)}")
        check(self.loss_type in DPO_LOSS_TYPES,
              f"preference.loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {show(self.loss_type)}")
        check(0 < self.beta <= 1000, f"preference.beta must be in (0, 1000], got {show(self.beta)}")
        check(0 <= self.label_smoothing < 0.5,
              f"preference.label_smoothing must be in [0, 0.5) (the chance a label is flipped), got {show(self.label_smoothing)}")
        check(self.label_smoothing > 0 or self.loss_type != "exo_pair",
              "preference.loss_type exo_pair needs label_smoothing > 0 (its target is [1 - e, e]); TRL uses 1e-3")
        check(self.label_smoothing == 0 or self.loss_type in SMOOTHED_LOSS_TYPES,
              f"preference.label_smoothing is read only by loss_type {' and '.join(SMOOTHED_LOSS_TYPES)}, "
              f"not {show(self.loss_type)}: set it to 0 or choose one of them")
        check(self.share_prompt in SHARE_PROMPT_MODES,
              f"preference.share_prompt must be one of {', '.join(SHARE_PROMPT_MODES)}, got {show(self.share_prompt)}")
        check(0 <= self.simpo_gamma <= 100, f"preference.simpo_gamma must be 0..100, got {show(self.simpo_gamma)}")
        check(0 <= self.cpo_alpha <= 100, f"preference.cpo_alpha must be 0..100, got {show(self.cpo_alpha)}")
        for name in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, name)
            check(0 < value <= 1000, f"preference.{name} must be in (0, 1000], got {show(value)}")
