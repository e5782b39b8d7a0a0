"""What a unit of each tensor role's error costs in output quality, measured end to end.

Sensitivity gives every tensor's noise-to-signal ratio per type; those ratios are comparable
within a role but not across roles: noise in the output head lands in the logits as it is, noise
in a key projection is diluted by the softmax and the residual stream. So for each role (attn_q,
ffn_down, output, token_embd, ...) one probe model is made: that role's tensors at their probe
type (probe_type), everything else as in the F16. Its mean KL divergence from the F16 model on
calibration text, divided by the role's summed relative error, is the role's gain: KLD per unit
of relative error. The planner then minimizes predicted KLD, sum(gain[role(t)] * error[t]), which
is what the report measures.

llama.cpp quantizes each tensor on its own (its data depends on the tensor, its type and its
importance alone), so one quantize serves every probe: every tensor at its probe type, and each
probe is the F16 file with one role's tensors spliced in from it (Splicer). A probe then costs
one evaluation of the first PROBE_CTX tokens of a calibration chunk, scored from position
PROBE_FIRST on against the F16's logits, which calibration computed (about 10 probes for a
transformer); the result is cached with the other intermediates."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import struct
from pathlib import Path
from typing import Callable, Sequence

from edgerun.convert.report import Reference
from edgerun.convert.sensitivity import TensorCost, type_nbytes
from edgerun.errors import ConvertError

Progress = Callable[[str, int, int], None]

PROBE_FTYPE = "Q8_0"  # the probe quantize's recipe: every tensor is overridden, this only labels the file
PROBE_CHUNKS = 1  # calibration chunks each probe is evaluated on
# tokens of a probe's chunk (at most the calibration's n_ctx): the start of calibration's first
# chunk, whose logits calibration hands over. A probe's forward pass is most of its cost.
PROBE_CTX = 256
# first scored position of a probe's chunk: 239 of 256 positions scored, where the report's
# n_ctx/2 would score 127 (a gain is a ratio of KLDs on the same positions; it needs many
# positions, not long contexts)
PROBE_FIRST = 16
# Every tensor whose rows hold it is probed at Q4_0: its error stands out of the probes' noise
# in every role, and ggml quantizes it with an imatrix about 4x faster than Q2_K, whose search
# was half the probe quantize on the 0.5B (its ffn_down rows take k-quants). A gain is the
# role's KLD per unit of error at either type: on the 0.5B at Q3_K_M's size ffn_down's measured
# 0.0726 at Q4_0 and 0.0730 at Q2_K, and the plan was the same.
PROBE_TYPE = "Q4_0"
MIN_GAIN_SHARE = 0.01  # a role whose probe moved KLD by less than noise gets this share of the median gain

_LAYER = re.compile(r"^blk\.\d+\.")


def role_of(name: str) -> str:
    """The tensor's role: its name without the layer prefix (blk.3.attn_v.weight -> attn_v.weight)."""
    return _LAYER.sub("", name)


def probe_type(cost: TensorCost) -> str:
    """PROBE_TYPE where it is a candidate, else the tensor's cheapest candidate type (the one
    whose error stands out most from the base)."""
    if PROBE_TYPE in cost.errors:
        return PROBE_TYPE
    return min(cost.errors, key=lambda t: (type_nbytes(t, cost.n_elements), -cost.errors[t]))


def measure(f16: Path, costs: Sequence[TensorCost], text: str, *, work: Path, imatrix, n_ctx: int = PROBE_CTX,
            chunks: int = PROBE_CHUNKS, first: int = PROBE_FIRST, n_threads: int | None = None,
            progress: Progress | None = None, known: Sequence = ()) -> dict[str, float]:
    """Each role's gain (see the module docstring). `costs` must be relative (noise-to-signal);
    `known`: the F16's logits on calibration chunks, as report.Reference takes them."""
    from edgerun.convert.quantize import quantize
    from edgerun.models.gguf_check import inspect

    roles: dict[str, list[TensorCost]] = {}
    for c in costs:
        roles.setdefault(role_of(c.name), []).append(c)
    steps = len(roles) + 2
    if progress:
        progress("weigh roles", 0, steps)
    work.mkdir(parents=True, exist_ok=True)
    cheap, probe = work / "cheap.gguf", work / "probe.gguf"
    kld: dict[str, float] = {}
    try:
        quantize(f16, cheap, ftype=PROBE_FTYPE, overrides={c.name: probe_type(c) for c in costs}, imatrix=imatrix,
                 n_threads=n_threads)
        if progress:
            progress("weigh roles", 1, steps)
        reference = Reference(f16, text, n_ctx=n_ctx, max_chunks=chunks, first=first, n_threads=n_threads,
                              known=known)
        if progress:
            progress("weigh roles", 2, steps)
        splicer = Splicer(f16, cheap)
        # a probe is spliced from two validated files (the F16 the reference loaded, the
        # quantize checked here): it is loaded under the F16's info, not parsed again per probe
        inspect(cheap)
        info = dataclasses.replace(inspect(f16), path=probe.resolve())
        for i, role in enumerate(sorted(roles)):
            splicer.write({c.name for c in roles[role]}, probe)
            kld[role] = reference.kld_mean(probe, info=dataclasses.replace(info, size=probe.stat().st_size))
            if progress:
                progress("weigh roles", 3 + i, steps)
    finally:
        for path in (cheap, probe):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    raw = {role: kld[role] / max(sum(c.errors[probe_type(c)] for c in roles[role]), 1e-30) for role in roles}
    positive = sorted(g for g in raw.values() if g > 0)
    floor = MIN_GAIN_SHARE * positive[len(positive) // 2] if positive else 1.0
    return {role: max(g, floor) for role, g in raw.items()}


class Splicer:
    """GGUFs made of BASE with some of its tensors taken from OTHER, another file of the same
    model (e.g. its quantize): BASE's metadata and tensor order, each tensor's info with its type
    and new offset, its data at BASE's alignment. Where BASE and OTHER are two quantizes with one
    recipe, that is byte for byte the file the quantizer writes with those tensors overridden to
    OTHER's types. Both files are mapped, not read; each write is a scratch file (not fsynced)."""

    def __init__(self, base: Path, other: Path):
        from edgerun.convert.tensors import open_gguf

        self.base, self.other = Path(base), Path(other)
        self.a, self.b = open_gguf(base), open_gguf(other)
        self.theirs = {t.name: t for t in self.b.tensors}
        shapes = {t.name: t.shape for t in self.a.tensors}
        if any(shapes.get(name, t.shape) != t.shape for name, t in self.theirs.items()):
            raise ConvertError(f"{base} and {other} are not files of one model; delete the convert cache and run again")

    def write(self, names: set[str], dst: Path) -> Path:
        from edgerun.convert.tensors import n_bytes

        a, b = self.a, self.b
        missing = sorted(names - (self.theirs.keys() & {t.name for t in a.tensors}))
        if missing:
            raise ConvertError(f"{self.base} or {self.other} has no tensor {missing[0]!r}; "
                               "delete the convert cache and run again")
        chosen = [(b, self.theirs[t.name]) if t.name in names else (a, t) for t in a.tensors]
        pad = lambda n: -n % a.alignment  # noqa: E731
        infos, offset = [], 0
        for _, t in chosen:
            name = t.name.encode()
            infos.append(struct.pack("<Q", len(name)) + name + struct.pack(f"<I{len(t.shape)}QIQ", len(t.shape),
                                                                            *t.shape, int(t.tensor_type), offset))
            offset += n_bytes(t) + pad(n_bytes(t))
        with open(dst, "wb") as f:
            f.write(memoryview(a.data[:a.tensor_info_offset]))  # header and metadata, as BASE has them
            for info in infos:
                f.write(info)
            f.write(bytes(pad(f.tell())))
            for reader, t in chosen:
                f.write(memoryview(reader.data[t.data_offset:t.data_offset + n_bytes(t)]))
                f.write(bytes(pad(n_bytes(t))))
        return Path(dst)


def weigh(costs: Sequence[TensorCost], gains: dict[str, float]) -> list[TensorCost]:
    """Each tensor's errors times its role's gain: predicted KLD per type (pure: no model needed)."""
    missing = sorted({role_of(c.name) for c in costs} - gains.keys())
    if missing:
        raise ConvertError(f"no measured gain for {', '.join(missing)}; delete the convert cache and run again")
    return [dataclasses.replace(c, errors={t: e * gains[role_of(c.name)] for t, e in c.errors.items()})
            for c in costs]
