"""What a unit of each tensor role's error costs in output quality, measured end to end.

Sensitivity gives every tensor's noise-to-signal ratio per type; those ratios are comparable
within a role but not across roles: noise in the output head lands in the logits as it is, noise
in a key projection is diluted by the softmax and the residual stream. So for each role (attn_q,
ffn_down, output, token_embd, ...) one probe model is quantized: that role's tensors at their
cheapest candidate type, everything else at a near-lossless base. Its mean KL divergence from the
F16 model on calibration text, less the base's own, divided by the role's summed relative error,
is the role's gain: KLD per unit of relative error. The planner then minimizes predicted KLD,
sum(gain[role(t)] * error[t]), which is what the report measures.

The probes cost one quantize and one short evaluation each (about 10 for a transformer), so the
result is cached with the other intermediates."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Callable, Sequence

from edgerun.convert.report import Reference
from edgerun.convert.sensitivity import TensorCost, type_nbytes
from edgerun.errors import ConvertError

Progress = Callable[[str, int, int], None]

PROBE_BASE = "Q8_0"  # everything outside the probed role: about 1e-3 KLD, and half F16's bytes to read
PROBE_CHUNKS = 2  # calibration chunks each probe is evaluated on
MIN_GAIN_SHARE = 0.01  # a role whose probe moved KLD by less than noise gets this share of the median gain

_LAYER = re.compile(r"^blk\.\d+\.")


def role_of(name: str) -> str:
    """The tensor's role: its name without the layer prefix (blk.3.attn_v.weight -> attn_v.weight)."""
    return _LAYER.sub("", name)


def probe_type(cost: TensorCost) -> str:
    """The tensor's cheapest candidate type: the one whose error stands out most from the base."""
    return min(cost.errors, key=lambda t: (type_nbytes(t, cost.n_elements), -cost.errors[t]))


def measure(f16: Path, costs: Sequence[TensorCost], text: str, *, work: Path, imatrix, n_ctx: int = 512,
            chunks: int = PROBE_CHUNKS, n_threads: int | None = None,
            progress: Progress | None = None) -> dict[str, float]:
    """Each role's gain (see the module docstring). `costs` must be relative (noise-to-signal)."""
    from edgerun.convert.quantize import quantize

    roles: dict[str, list[TensorCost]] = {}
    for c in costs:
        roles.setdefault(role_of(c.name), []).append(c)
    reference = Reference(f16, text, n_ctx=n_ctx, max_chunks=chunks, n_threads=n_threads)
    work.mkdir(parents=True, exist_ok=True)
    probe = work / "probe.gguf"
    steps = len(roles) + 1
    kld: dict[str | None, float] = {}
    try:
        for i, role in enumerate([None, *sorted(roles)]):
            if progress:
                progress("weigh roles", i, steps)
            overrides = {c.name: probe_type(c) for c in roles[role]} if role else {}
            quantize(f16, probe, ftype=PROBE_BASE, overrides=overrides, imatrix=imatrix, n_threads=n_threads)
            kld[role] = reference.compare(probe).kld_mean
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()
    if progress:
        progress("weigh roles", steps, steps)
    base = kld.pop(None)
    raw = {role: (kld[role] - base) / max(sum(c.errors[probe_type(c)] for c in roles[role]), 1e-30)
           for role in roles}
    positive = sorted(g for g in raw.values() if g > 0)
    floor = MIN_GAIN_SHARE * positive[len(positive) // 2] if positive else 1.0
    return {role: max(g, floor) for role, g in raw.items()}


def weigh(costs: Sequence[TensorCost], gains: dict[str, float]) -> list[TensorCost]:
    """Each tensor's errors times its role's gain: predicted KLD per type (pure: no model needed)."""
    missing = sorted({role_of(c.name) for c in costs} - gains.keys())
    if missing:
        raise ConvertError(f"no measured gain for {', '.join(missing)}; delete the convert cache and run again")
    return [dataclasses.replace(c, errors={t: e * gains[role_of(c.name)] for t, e in c.errors.items()})
            for c in costs]
