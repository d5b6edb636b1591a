"""Preference training: DPO (sigmoid, IPO, hinge), ORPO, SimPO and KTO.

    from kestrel.training.preference import run_preference
    status, last_step = run_preference(config, output_dir, cb)   # config.method in dpo|orpo|kto|simpo

loss.py (the objectives, TRL's definitions), rows.py (answer log-probs of many rows in one forward
through the chunked fused path), reference.py (the adapter-disabled reference, precomputed or per
step), data.py (reading, tokenizing, batch order), trainer.py (the run).
"""

from kestrel.training.preference.trainer import run_preference

__all__ = ["run_preference"]
