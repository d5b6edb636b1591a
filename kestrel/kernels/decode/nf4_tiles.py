"""Which tiles `nf4_gemv.py` launches per shape and row count: measured where a sweep measured them,
else a cost model.

A measured plan comes from `bench/nf4_gemv_sweep.py`, which times every candidate of a grid on
the device at rows 1, 2, 8 and 16 and writes the fastest (and whether the kernel beats
bitsandbytes' own GEMV at one row) into `nf4_gemv_tiles.json` beside this file, keyed by the device
name and the weight's (N, K). Any other shape or device gets `choose_tiles`, the least `tile_cost`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from kestrel.kernels._utils import cdiv, next_pow2

MAX_ROWS = 16  # rows of x one launch takes (the tensor-core tile's M)
TABLE = Path(__file__).with_name("nf4_gemv_tiles.json")
# Lookups: one 16-entry code gather per weight; one 256-entry pair gather per byte; the block's 16
# values in registers, read by byte permutes (`nf4_lookup.py`; compiled CUDA only).
NIBBLE, PAIR, PRMT = 0, 1, 2
# Per path (one row; tensor cores): BLOCK_K, warps, programs an SM holds at once.
_FMA_K, _FMA_WARPS, _RESIDENT_FMA = 512, 2, 16
_DOT_K, _DOT_WARPS, _RESIDENT_DOT = 128, 4, 4
_VALUES_PER_THREAD = 64  # decoded weight values per thread per step (registers)
_INFLIGHT_PER_SM = 32 * 1024  # bytes in flight per SM that cover memory latency (Little's law: bandwidth x latency / SMs)
_X_COST = 0.4  # a byte of x from cache, against a byte of weight from HBM
_PARTIAL_COST = 2.0  # a byte of split-K partials: written, then read back in series by the last split


class Tiles(NamedTuple):
    block_m: int  # 1: fp32 multiply-adds; 16: tensor cores
    block_n: int
    block_k: int
    split: int
    warps: int = 4
    stages: int = 1
    lookup: int = PAIR
    prefetch: bool = False  # load the next tile's bytes before decoding this one
    parts: int = 1  # each block's bytes loaded as this many tensors (1 or 2; `nf4_gemv._fma_rows`)
    groups: int = 1  # one row of x: the tile's rows loaded as this many tensors (1 or 2; no prefetch with 2)


@dataclass(frozen=True)
class Plan:
    """Measured tiles of one (device, N, K): `tiles` ((rows, Tiles), ...) ascending by rows, and
    whether the kernel was faster than bitsandbytes' GEMV at one row (`kernel_one_row`)."""

    tiles: tuple[tuple[int, Tiles], ...]
    kernel_one_row: bool

    def for_rows(self, m: int) -> Tiles | None:
        """The tiles measured at the fewest rows >= m, one row's only for one row (either path)."""
        one_row = m == 1  # under torch.compile m may be symbolic: compare it, never bool == SymBool
        for rows, t in self.tiles:
            if rows >= m and (one_row if rows == 1 else not one_row):
                return t
        return None


def device_name(device: torch.device | str) -> str:
    """The table's key for a torch device: the CUDA device's name, else its type ("cpu")."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def measured_plan(device: str, n: int, k: int, path: Path | None = None) -> Plan | None:
    """The plan the sweep stored for an (n, k) weight on `device` (`device_name`) in the table at
    `path` (default TABLE), or None."""
    entry = _read(str(path or TABLE)).get(device, {}).get(f"{n}x{k}")
    if entry is None:
        return None
    tiles = tuple(sorted((int(rows), Tiles(*t)) for rows, t in entry["tiles"].items()))
    return Plan(tiles, bool(entry["kernel_one_row"]))


def store_plan(device: str, n: int, k: int, plan: Plan, path: Path | None = None) -> None:
    """Write `plan` for (device, n, k) into the table at `path` (default TABLE), keeping its other entries."""
    path = path or TABLE
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(device, {})[f"{n}x{k}"] = {"tiles": {str(rows): list(t) for rows, t in plan.tiles},
                                                 "kernel_one_row": plan.kernel_one_row}
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _read.cache_clear()


@functools.lru_cache(maxsize=8)
def _read(path: str) -> dict:
    """The table's contents ({} when there is none); read once per process (the sweep clears it)."""
    p = Path(path)
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON ({exc}); delete it or rerun bench/nf4_gemv_sweep.py") from exc


def choose_tiles(m: int, n: int, k: int, blocksize: int, sms: int) -> Tiles:
    """The tiles of least `tile_cost` for m rows of x times an (n, k) weight on `sms` SMs
    (plain integer work, traced as is inside torch.compile): BLOCK_N and SPLIT from the model, per
    shape and m; BLOCK_K and warps fixed per path (one row: _FMA_*; tensor cores: _DOT_*)."""
    if m == 1:
        block_m, warps, rows, block_k = 1, _FMA_WARPS, (1, 2, 4, 8, 16), _FMA_K
    else:
        block_m, warps, rows, block_k = MAX_ROWS, _DOT_WARPS, (16, 32, 64, 128), _DOT_K
    block_k = max(blocksize, min(block_k, next_pow2(k)))
    best: tuple[float, int, Tiles] | None = None
    for block_n in rows:
        if block_n * block_k > _VALUES_PER_THREAD * 32 * warps and block_n > rows[0]:
            break
        for split in (1, 2, 4, 8, 16):
            if split > 1 and cdiv(k, block_k) < 2 * split:
                break
            t = Tiles(block_m, block_n, block_k, split, warps)
            key = (tile_cost(t, m, n, k, sms), cdiv(n, block_n) * split, t)
            best = key if best is None or key[:2] < best[:2] else best
    assert best is not None
    return best[2]


def tile_cost(t: Tiles, m: int, n: int, k: int, sms: int) -> float:
    """Relative time of a launch with tiles `t`, in bytes of HBM:
    - bytes in flight: a program has one (BLOCK_N, BLOCK_K / 2)-byte tile of packed weight in
      flight at a time, and an SM holds _RESIDENT_* programs at once, so by Little's law a launch
      streams at about min(bandwidth, resident programs x tile bytes / latency); the weight's
      bytes are divided by that fraction of the bandwidth, reached at _INFLIGHT_PER_SM bytes per SM;
    - balance: the busiest SM runs ceil(programs / SMs) programs, the bandwidth is divided by
      programs / (SMs x that);
    - x re-reads: every program loads its K range of all M rows of x (M x 2 bytes a column, from
      L1/L2) against BLOCK_N x 9/16 bytes of weight: _X_COST a byte, which favours tall row tiles;
    - split-K partials: 8 SPLIT M bytes a row (written, read back by the last split in series),
      _PARTIAL_COST a byte.
    `choose_tiles` also caps the decoded tile (BLOCK_N x BLOCK_K values over 32 x warps threads)
    at _VALUES_PER_THREAD a thread. The model counts bytes only, not the work of decoding them:
    a measured plan (`measured_plan`) takes precedence wherever the sweep ran."""
    programs = cdiv(n, t.block_n) * t.split
    resident = min(programs, sms * (_RESIDENT_FMA if t.block_m == 1 else _RESIDENT_DOT))
    inflight = resident * t.block_n * t.block_k // 2
    balance = programs / (sms * cdiv(programs, sms))  # the busiest SM has ceil(programs / sms)
    weight = n * k * 9 // 16  # packed nibbles + fp32 absmax
    x_reads = programs * cdiv(k, t.split) * m * 2
    partials = 8 * t.split * m * n if t.split > 1 else 0  # fp32, written and read back
    streamed = weight / (min(1.0, inflight / (_INFLIGHT_PER_SM * sms)) * balance)
    return streamed + x_reads * _X_COST + partials * _PARTIAL_COST
