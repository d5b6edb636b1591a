"""The devices part of the training config: `devices: 1 | N | auto | [ids]` (one run, data parallel
across them; see `kestrel.training.distributed`). `TrainConfig` holds the field and calls
`check_devices_setting` from its own checks; torch-free, like the rest of the config.
"""

from __future__ import annotations

from typing import Any

from kestrel.config_values import check

MAX_DEVICES = 64


def check_devices_setting(cfg: Any) -> None:
    """`devices`: auto, a count 1..MAX_DEVICES, or a list of distinct GPU ids (ConfigError naming
    the field otherwise)."""
    d = cfg.devices
    if isinstance(d, str):
        check(d == "auto", f"devices must be auto, a number of devices or a list of GPU ids, got {d[:40]!r}")
    elif isinstance(d, list):
        check(0 < len(d) <= MAX_DEVICES, f"devices must list 1..{MAX_DEVICES} GPU ids, got {d!r:.80}")
        bad = next((i for i in d if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_DEVICES), None)
        check(bad is None, f"devices: each GPU id must be a whole number 0..{MAX_DEVICES - 1}, got {bad!r:.40}")
        check(len(set(d)) == len(d), f"devices lists a GPU twice: {d!r:.80}")
    else:
        check(not isinstance(d, bool) and isinstance(d, int) and 1 <= d <= MAX_DEVICES,
              f"devices must be 1..{MAX_DEVICES}, auto or a list of GPU ids, got {d!r:.40}")
