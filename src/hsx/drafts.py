"""Draft types and the target layers (taps) each one reads, in hsx's ids.

A draft type fixes how many taps a draft reads and where they sit by default:
- ``eagle3``: EAGLE-3's three, ``[1, N//2-1, N-4]`` (N = the target's decoder layers);
- ``dflash:n`` (DFlash, DFlash2, DSpark, P-EAGLE, XPress): one tap per draft layer, by the formula
  SpecForge and Model-Optimizer share: one tap, layer ``N//2``; n taps, ``round(1 + i*(N-4)/(n-1))``
  for i in 0..n-1, ``round`` half to even (N = 36, n = 5: 1, 9, 17, 25, 33; N = 11: 1, 3, 4, 6, 8).
  Both count as hsx does (their ``hidden_states[id + 1]``); speculators and vLLM count one higher;
- ``mtp``: none; multi-token prediction reads the final state alone.

``--layers`` takes such a preset or explicit ids; the run spec records the ids and, for a preset,
the formula that gave them (``Taps.formula``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hsx.errors import OptionError

EAGLE3, MTP = "eagle3", "mtp"
# the draft types hsx exports for (hsx.export: which trainer trains which): P-EAGLE reads EAGLE-3's
# three taps, MTP none, the others the DFlash family's (one per draft layer)
DRAFT_TYPES = (EAGLE3, "dflash", "dflash2", "dspark", "peagle", "xpress", MTP)
EAGLE_TAPS = (EAGLE3, "peagle")
DFLASH_TAPS = 5  # ``dflash`` without a count: z-lab's and the trainers' examples' 5 draft layers
PRESET = re.compile(r"^(eagle3|mtp|dflash)(?::(\d+))?$")
PRESETS = "eagle3, dflash[:N] (N taps, default 5) or mtp"


@dataclass(frozen=True)
class Taps:
    """The taps of a run, in hsx ids, and the preset's formula that gave them (None: given as ids)."""

    ids: list[int]
    formula: str | None = None


def eagle3_formula(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers as its formula gives them: [1, N//2-1, N-4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def eagle3_taps(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers; on a model of fewer than 7 layers, where the formula's fall
    outside it or coincide, clipped to its layers, de-duplicated and sorted (``resolve`` says so)."""
    return sorted({min(max(k, 0), num_layers - 1) for k in eagle3_formula(num_layers)})


def dflash_taps(n: int, num_layers: int) -> list[int]:
    """The DFlash family's n taps of an N-layer target, exactly as its formula gives them (module
    docstring; Python's ``round``, half to even, as SpecForge's and Model-Optimizer's own); refused
    where they fall outside the model or repeat."""
    if not 1 <= n <= num_layers:
        raise OptionError(f"dflash:{n}: a DFlash draft takes 1 to {num_layers} taps of this {num_layers}-layer model")
    if n == 1:
        return [num_layers // 2]
    ids = [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    if len(set(ids)) != n or not all(0 <= k < num_layers for k in ids):
        what = "repeated layers" if len(set(ids)) != n else "layers outside 0..N-1"
        raise OptionError(f"dflash:{n}: the formula gives {what} {ids} on this {num_layers}-layer model: give ids")
    return ids


def check_preset(value: str) -> str:
    """``value`` as a preset name (``eagle3``, ``dflash``, ``dflash:N``, ``mtp``); refused otherwise."""
    m = PRESET.match(value.strip())
    if m is None or (m.group(2) is not None and m.group(1) != "dflash"):
        raise OptionError(f"--layers takes comma-separated layer ids or a draft preset ({PRESETS}), not {value!r}")
    if m.group(2) is not None and int(m.group(2)) < 1:
        raise OptionError(f"--layers {value}: a DFlash draft takes at least 1 tap")
    return value.strip()


def resolve(layers: list[int] | str | None, num_layers: int) -> Taps:
    """The taps a run captures: explicit ids as given, a preset's by its formula, EAGLE-3's by default."""
    if isinstance(layers, list):
        return Taps(list(layers))
    name, _, count = check_preset(layers or "eagle3").partition(":")
    if name == "mtp":
        return Taps([], "mtp: no taps, the final state alone")
    if name == "eagle3":
        ids, rule = eagle3_taps(num_layers), f"eagle3: [1, N//2-1, N-4], N = {num_layers}"
        if ids != eagle3_formula(num_layers):  # a model too small for three distinct taps in it
            rule += f" gives {eagle3_formula(num_layers)}: clipped to layers 0..{num_layers - 1}, de-duplicated, {ids}"
        return Taps(ids, rule)
    n = int(count or DFLASH_TAPS)
    rule = "N//2" if n == 1 else f"round(1 + i*(N-4)/(n-1)), i = 0..{n - 1}"
    return Taps(dflash_taps(n, num_layers), f"dflash:{n}: {rule}, N = {num_layers}")


def bytes_per_token(taps: int, hidden: int, itemsize: int) -> int:
    """Bytes one token costs on disk, raw: each tap's state and the final state (``hidden`` values of
    ``itemsize`` bytes each), its token id (8) and loss mask (1). A codec scales the states."""
    return (taps + 1) * hidden * itemsize + 8 + 1


def storage_lines(num_layers: int, hidden: int, dtype: str, teacher: int = 0) -> list[str]:
    """What a sample costs on disk for each draft preset of this model (``hsx memory``); ``teacher``:
    the bytes of a ``--teacher`` row, which each loss-masked token adds."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    presets = ("eagle3", f"dflash:{DFLASH_TAPS}", "mtp")
    taps = {p: resolve(p, num_layers).ids for p in presets}
    base = bytes_per_token(len(taps["eagle3"]), hidden, itemsize)
    out = [f"storage per token, raw {dtype} (zstd stores about 0.7x of it, fp8 half of bf16's states):"]
    for p in presets:
        n = bytes_per_token(len(taps[p]), hidden, itemsize)
        what = f"{len(taps[p])} taps {taps[p]} + the final state" if taps[p] else "the final state alone"
        size = f"{n:,} bytes, {n * 1000 / 1e6:,.1f} MB per 1,000 tokens ({n / base:.2f}x eagle3)"
        out.append(f"  --layers {p}: {what}: {size}")
    if teacher:
        out.append(f"  --teacher: {teacher:,} bytes per loss-masked token ({teacher / base:.2f}x eagle3's per token)")
    return out
