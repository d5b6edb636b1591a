"""Which offloaded layers also page their MLP gate product out to host memory (no torch here: the
memory estimate uses it before anything loads).

A `share` of the layers, 0 to 1, spread evenly over the depth: layer `depth` pages its gate out
when int((depth + 1) share) > int(depth share), so over L layers int(L share) of them do.
"""

from __future__ import annotations

from kestrel import env


def gate_share(configured: float = 1.0) -> float:
    """The share of offloaded layers that page their gate product out, 0 to 1: KESTREL_OFFLOAD_GATE
    (a debugging override) wins over the configured one."""
    try:
        share = env.number("KESTREL_OFFLOAD_GATE", configured)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"KESTREL_OFFLOAD_GATE={env.raw('KESTREL_OFFLOAD_GATE')!r} is not valid: "
                         "a share of the layers, 0 to 1")
    return share


def pages_gate_out(depth: int, share: float) -> bool:
    """Whether the offloaded layer `depth` layers from the bottom pages its gate product out."""
    return int((depth + 1) * share) > int(depth * share)


def paged_gate_layers(layers: int, share: float) -> int:
    """How many of `layers` offloaded layers page their gate product out."""
    return sum(pages_gate_out(depth, share) for depth in range(layers))
