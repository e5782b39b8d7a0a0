"""floats.py: bfloat16 as 16-bit patterns, rounded to nearest even (as torch rounds), converted a
block at a time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from edgerun.convert import floats

finite_f32_bits = st.integers(0, 2**32 - 1).filter(lambda b: (b >> 23) & 0xFF != 0xFF)


def bf16_value(pattern: int) -> float:
    """A bfloat16 pattern's value, exactly; exponent 255 reads as the power of two past the largest
    finite value (what a value between the two would round towards: infinity)."""
    sign = -1.0 if pattern & 0x8000 else 1.0
    exp, mantissa = (pattern >> 7) & 0xFF, pattern & 0x7F
    if exp == 0:
        return sign * mantissa * 2.0**-133
    return sign * (1 + mantissa / 128) * 2.0 ** (exp - 127)


def nearest_bf16(bits: int) -> int:
    """The rounding rule itself: of the two bfloat16s around x, the nearer; on a tie, the even one."""
    x = float(np.uint32(bits).view(np.float32))
    lo = bits >> 16  # toward zero; lo + 1 is the next one away from zero
    below, above = abs(x - bf16_value(lo)), abs(bf16_value(lo + 1) - x)
    if below != above:
        return lo if below < above else lo + 1
    return lo if lo % 2 == 0 else lo + 1


# ties: between 1.0 and the next (to 1.0, even); between two with the odd one below (up); between
# the largest finite bfloat16 (odd) and what would follow it (to infinity); the negative twins
TIES = [0x3F808000, 0x3F818000, 0x7F7F8000, 0xBF808000, 0xBF818000, 0xFF7F8000]


@example(TIES)
@given(st.lists(finite_f32_bits, min_size=1, max_size=64))
def test_bf16_rounds_to_nearest_even(bits):
    x = np.array(bits, dtype=np.uint32).view(np.float32)
    got = floats.to_bf16(x, "F32")
    assert got.dtype == np.uint16
    assert got.tolist() == [nearest_bf16(b) for b in bits]


def test_bf16_keeps_nan_and_infinities():
    x = np.array([np.nan, np.inf, -np.inf, 3.4e38], dtype=np.float32)
    got = floats.to_bf16(x, "F32")
    back = floats.to_f32(got, "BF16")
    assert np.isnan(back[0]) and back[1] == np.inf and back[2] == -np.inf
    assert back[3] == np.inf  # past bfloat16's largest finite value, to nearest is infinity


@given(st.lists(st.integers(0, 2**16 - 1).filter(lambda b: (b >> 7) & 0xFF != 0xFF), min_size=1, max_size=64))
def test_bf16_widens_exactly_and_narrows_back(patterns):
    stored = np.array(patterns, dtype=np.uint16)
    wide = floats.to_f32(stored, "BF16")
    assert wide.view(np.uint32).tolist() == [p << 16 for p in patterns]
    assert floats.to_bf16(wide, "F32").tolist() == patterns
    with np.errstate(over="ignore"):  # past float16's range: inf on both sides
        np.testing.assert_array_equal(floats.to_f16(stored, "BF16"), wide.astype(np.float16))


@pytest.mark.parametrize("shape", [(), (0, 4), (7,), (5, 3), (2, 3, 4)])
def test_blocks_convert_as_the_whole(shape, monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(1e3)
    whole_f16, whole_bf16 = x.astype(np.float16), floats.to_bf16(x, "F32")
    monkeypatch.setattr(floats, "_BLOCK", 2)  # every tensor in several blocks
    assert floats.to_f16(x, "F32").shape == shape
    np.testing.assert_array_equal(floats.to_f16(x, "F32"), whole_f16)
    np.testing.assert_array_equal(floats.to_bf16(x, "F32"), whole_bf16)
    np.testing.assert_array_equal(floats.to_f16(floats.to_bf16(x, "F32"), "BF16"),
                                  floats.to_f32(whole_bf16, "BF16").astype(np.float16))


def test_stored_f16_and_bf16_pass_through_unchanged():
    f16 = np.arange(6, dtype=np.float16).reshape(2, 3)[:, ::-1]  # not contiguous
    out = floats.to_f16(f16, "F16")
    assert out.flags.c_contiguous and np.array_equal(out, f16)
    bits = np.arange(6, dtype=np.uint16).reshape(2, 3)[:, ::-1]
    out = floats.to_bf16(bits, "BF16")
    assert out.flags.c_contiguous and np.array_equal(out, bits)
