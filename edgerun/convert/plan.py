"""The quantization plan: one ggml type per tensor, the least total weighted error within a byte
budget. Pure: measured costs in, decision out.

The solver is a multiple-choice knapsack solved by dynamic programming over bytes counted in
grains of g bytes:
- every tensor's cheapest allowed type is paid exactly; only the extra bytes of a dearer type are
  rounded *up* to whole grains, so any plan the DP accepts is within the budget in true bytes;
- g is the gcd of all those extra byte counts whenever that needs at most MAX_CELLS cells, and
  then the DP is exact (it equals brute force); otherwise g is the smallest multiple of that gcd
  that fits in MAX_CELLS, and rounding costs less than g bytes per tensor, so
      OPT(B) <= error(choose(B)) <= OPT(B - n*g)       (n tensors),
  i.e. the plan is at least as good as the true optimum with n*g fewer bytes (for a 1.5B model:
  ~200 tensors, g ~ 2 KiB, under 0.05% of the budget);
- g depends only on the costs, never on the budget, and the DP table holds the best error with
  *at most* c grains, so the chosen error never increases when the budget grows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edgerun.convert.sensitivity import TensorCost, type_nbytes
from edgerun.errors import ConvertError

# Cells of the DP table; the choice table is n_tensors x cells bytes (~200 MB at worst for 200
# tensors, ~70 MB for a typical budget).
MAX_CELLS = 1 << 20


@dataclass(frozen=True)
class Plan:
    types: dict[str, str]  # tensor name -> ggml type name
    nbytes: int  # bytes of every tensor, fixed_bytes included
    error: float  # sum of the chosen types' weighted errors
    budget_bytes: int
    grain: int  # DP grain in bytes; the plan is exact when `exact`
    exact: bool


@dataclass(frozen=True)
class _Options:
    """One tensor's non-dominated choices, cheapest first."""

    name: str
    types: tuple[str, ...]
    nbytes: np.ndarray  # int64, ascending
    errors: np.ndarray  # float64, descending


def _options(cost: TensorCost) -> _Options:
    if not cost.errors:
        raise ConvertError(f"{cost.name}: no candidate type has a block size dividing its rows of "
                           f"{cost.row_len}; add a type such as Q8_0 or F16 to the candidates")
    rows = []
    for type_name, err in cost.errors.items():
        if not math.isfinite(err) or err < 0:
            raise ConvertError(f"{cost.name}: the measured error for {type_name} is {err}; "
                               "re-run the sensitivity measurement")
        rows.append((type_nbytes(type_name, cost.n_elements), float(err), type_name))
    rows.sort()
    kept: list[tuple[int, float, str]] = []
    for nbytes, err, type_name in rows:
        # a dearer type is only worth keeping if it is strictly more accurate
        if not kept or err < kept[-1][1]:
            kept.append((nbytes, err, type_name))
    return _Options(cost.name, tuple(t for _, _, t in kept),
                    np.array([b for b, _, _ in kept], dtype=np.int64),
                    np.array([e for _, e, _ in kept], dtype=np.float64))


def _grain(options: Sequence[_Options]) -> tuple[int, bool]:
    extras = [int(b - o.nbytes[0]) for o in options for b in o.nbytes[1:]]
    if not extras:
        return 1, True
    g = 0
    for e in extras:
        g = math.gcd(g, e)
    span = sum(int(o.nbytes[-1] - o.nbytes[0]) for o in options)
    scale = max(1, -(-span // (g * MAX_CELLS)))
    return g * scale, scale == 1


def choose(costs: Sequence[TensorCost], budget_bytes: int, *, fixed_bytes: int = 0) -> Plan:
    """One type per tensor minimizing the total weighted error with every tensor's bytes plus
    `fixed_bytes` (tensors that stay F32/F16) at most `budget_bytes`."""
    names = [c.name for c in costs]
    if len(set(names)) != len(names):
        raise ConvertError("the same tensor appears twice in the measured costs; re-run the measurement")
    options = [_options(c) for c in costs]
    base = fixed_bytes + sum(int(o.nbytes[0]) for o in options)
    if base > budget_bytes:
        raise ConvertError(f"a budget of {format_bytes(budget_bytes)} is below the smallest possible file "
                           f"({format_bytes(base)} of tensors with each at its smallest type); "
                           "allow more bytes with --size, --bpw or a larger --quant")
    grain, exact = _grain(options)
    # extra grains of each choice over the tensor's cheapest, rounded up so the plan never overshoots
    weights = [-(-(o.nbytes - o.nbytes[0]) // grain) for o in options]
    cap = int(min((budget_bytes - base) // grain, sum(int(w[-1]) for w in weights)))
    picks = _knapsack(weights, [o.errors for o in options], cap)
    types = {o.name: o.types[k] for o, k in zip(options, picks)}
    nbytes = base + sum(int(o.nbytes[k] - o.nbytes[0]) for o, k in zip(options, picks))
    error = math.fsum(float(o.errors[k]) for o, k in zip(options, picks))
    return Plan(types, nbytes, error, budget_bytes, grain, exact)


def _knapsack(weights: Sequence[np.ndarray], errors: Sequence[np.ndarray], cap: int) -> list[int]:
    """Multiple-choice knapsack: best[c] is the least error of the tensors so far using at most c
    grains (so it is non-increasing in c); exactly one choice per tensor."""
    n = len(weights)
    best = np.zeros(cap + 1)
    choice = np.zeros((n, cap + 1), dtype=np.int8)
    for i, (w, e) in enumerate(zip(weights, errors)):
        new = best + e[0]
        for k in range(1, len(w)):
            wk = int(w[k])
            if wk > cap:
                break
            cand = best[: cap + 1 - wk] + e[k]
            better = cand < new[wk:]  # strict: on a tie keep the cheaper type
            new[wk:][better] = cand[better]
            choice[i, wk:][better] = k
        best = new
    picks = [0] * n
    c = cap
    for i in range(n - 1, -1, -1):
        k = int(choice[i, c])
        picks[i] = k
        c -= int(weights[i][k])
    return picks


# --- budgets from the CLI's --bpw / --size / --quant ---

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """'900MB' (10^6), '0.9GB', '850MiB' (2^20), '123456' (bytes) -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ConvertError(f"--size '{text}' is not a size; write it like 900MB, 1.2GB or 850MiB")
    unit = (m.group(2) or "").lower().removesuffix("b")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConvertError(f"--size '{text}' must be more than zero bytes")
    return value


def budget_for_bpw(bpw: float, n_elements: int) -> int:
    """Bytes of tensor data at `bpw` bits per weight over every tensor (llama.cpp's definition of
    BPW: all tensor bytes * 8 / all elements, norms included)."""
    if not (0 < bpw <= 32):
        raise ConvertError(f"--bpw {bpw} is out of range; pick bits per weight between 2 and 16, e.g. 3.5")
    return int(bpw * n_elements / 8)


def budget_for_size(size_bytes: int, overhead_bytes: int) -> int:
    """Bytes of tensor data in a file of `size_bytes` whose header and alignment take
    `overhead_bytes` (measured on the F16 GGUF: its size minus its tensor bytes)."""
    budget = size_bytes - overhead_bytes
    if budget <= 0:
        raise ConvertError(f"--size {format_bytes(size_bytes)} is smaller than the file's header alone "
                           f"({format_bytes(overhead_bytes)}); pick a larger size")
    return budget


def budget_for_types(types: dict[str, str], n_elements: dict[str, int]) -> int:
    """Bytes of tensor data when each tensor has the given type (e.g. llama.cpp's stock recipe)."""
    return sum(type_nbytes(types[name], n) for name, n in n_elements.items())


def format_bytes(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 10**9 else f"{n / 1e9:,.3f} GB"
