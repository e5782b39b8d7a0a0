"""The quantization plan (pure): never over budget, monotone in the budget, equal to brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerun.convert import plan
from edgerun.convert.sensitivity import TensorCost, type_nbytes
from edgerun.errors import ConvertError

K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16")
SMALL_BLOCK_TYPES = ("Q4_0", "Q5_0", "Q8_0", "F16")  # rows not a multiple of 256


def _cost(name: str, rows: int, row_len: int, errors: dict[str, float]) -> TensorCost:
    return TensorCost(name=name, shape=(row_len, rows), n_elements=rows * row_len, row_len=row_len,
                      errors=errors)


@st.composite
def tensors(draw, max_tensors: int = 5):
    n = draw(st.integers(1, max_tensors))
    out = []
    for i in range(n):
        row_len = draw(st.sampled_from([256, 512, 896, 1536]))
        rows = draw(st.integers(1, 64))
        allowed = K_TYPES if row_len % 256 == 0 else SMALL_BLOCK_TYPES
        types = draw(st.lists(st.sampled_from(allowed), min_size=1, max_size=4, unique=True))
        # errors are arbitrary (not necessarily decreasing with bytes): the solver must cope
        errors = {t: draw(st.floats(0, 100, allow_nan=False)) for t in types}
        out.append(_cost(f"blk.{i}.w", rows, row_len, errors))
    return out


def _min_bytes(costs) -> int:
    return sum(min(type_nbytes(t, c.n_elements) for t in c.errors) for c in costs)


def _max_bytes(costs) -> int:
    return sum(max(type_nbytes(t, c.n_elements) for t in c.errors) for c in costs)


def _brute_force(costs, budget: int, fixed: int) -> float:
    best = math.inf
    for combo in itertools.product(*(list(c.errors) for c in costs)):
        nbytes = fixed + sum(type_nbytes(t, c.n_elements) for t, c in zip(combo, costs))
        if nbytes <= budget:
            best = min(best, math.fsum(c.errors[t] for t, c in zip(combo, costs)))
    return best


def _plan_bytes(p: plan.Plan, costs, fixed: int) -> int:
    return fixed + sum(type_nbytes(p.types[c.name], c.n_elements) for c in costs)


@settings(max_examples=150, deadline=None)
@given(costs=tensors(), frac=st.floats(0, 1.2), fixed=st.integers(0, 5000))
def test_never_over_budget_and_equals_brute_force(costs, frac, fixed):
    lo, hi = _min_bytes(costs) + fixed, _max_bytes(costs) + fixed
    budget = int(lo + frac * (hi - lo))
    p = plan.choose(costs, budget, fixed_bytes=fixed)
    assert set(p.types) == {c.name for c in costs}
    assert all(p.types[c.name] in c.errors for c in costs)  # only allowed types
    assert p.nbytes == _plan_bytes(p, costs, fixed) <= budget
    assert p.exact  # small instances always fit the exact grain
    assert p.error == pytest.approx(_brute_force(costs, budget, fixed), rel=1e-9, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(costs=tensors(max_tensors=8), a=st.floats(0, 1.2), b=st.floats(0, 1.2))
def test_error_never_increases_with_budget(costs, a, b):
    lo, hi = _min_bytes(costs), _max_bytes(costs)
    small, large = sorted((int(lo + a * (hi - lo)), int(lo + b * (hi - lo))))
    p_small, p_large = plan.choose(costs, small), plan.choose(costs, large)
    assert p_large.error <= p_small.error + 1e-9 * max(1.0, p_small.error)
    assert p_small.nbytes <= small and p_large.nbytes <= large


@settings(max_examples=50, deadline=None)
@given(costs=tensors())
def test_raises_when_even_the_smallest_types_do_not_fit(costs):
    with pytest.raises(ConvertError, match="smallest possible"):
        plan.choose(costs, _min_bytes(costs) + 99, fixed_bytes=100)
    plan.choose(costs, _min_bytes(costs) + 100, fixed_bytes=100)  # exactly at the edge fits


def test_coarse_grain_stays_within_the_stated_bound(monkeypatch):
    """With a grain above the gcd the plan is never over budget and at least as good as the exact
    optimum with n*grain fewer bytes."""
    costs = [_cost(f"blk.{i}.w", 8 + i, 256, {"Q2_K": 10.0 + i, "Q4_K": 3.0 + i / 2, "Q8_0": 0.1 * i})
             for i in range(5)]
    exact = {b: plan.choose(costs, b) for b in range(_min_bytes(costs), _max_bytes(costs) + 1, 97)}
    monkeypatch.setattr(plan, "MAX_CELLS", 16)
    for budget, best in exact.items():
        p = plan.choose(costs, budget)
        assert not p.exact and p.grain > 1
        assert p.nbytes <= budget and p.error >= best.error - 1e-12
        assert p.error <= _brute_force(costs, budget - len(costs) * p.grain, 0) + 1e-12


def test_prefers_the_cheaper_type_on_equal_error_and_drops_dominated_types():
    costs = [_cost("a", 4, 256, {"Q4_K": 1.0, "Q8_0": 1.0, "Q6_K": 2.0})]
    p = plan.choose(costs, 10**9)
    assert p.types == {"a": "Q4_K"} and p.nbytes == type_nbytes("Q4_K", 1024)


def test_tensor_without_allowed_types_is_an_error():
    with pytest.raises(ConvertError, match="block size"):
        plan.choose([_cost("a", 4, 896, {})], 10**9)


def test_spends_the_budget_where_error_drops_most():
    costs = [_cost("sensitive", 16, 256, {"Q2_K": 100.0, "Q8_0": 1.0}),
             _cost("robust", 16, 256, {"Q2_K": 2.0, "Q8_0": 1.0})]
    budget = type_nbytes("Q2_K", 4096) + type_nbytes("Q8_0", 4096)
    assert plan.choose(costs, budget).types == {"sensitive": "Q8_0", "robust": "Q2_K"}


@pytest.mark.parametrize("text,expected", [
    ("900MB", 900 * 10**6), ("1.5GB", 1_500_000_000), ("850MiB", 850 * 2**20), ("123456", 123456),
    ("2g", 2 * 10**9), ("512 KiB", 512 * 1024),
])
def test_parse_size(text, expected):
    assert plan.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "big", "-5MB", "0", "12XB", "1.2.3GB"])
def test_parse_size_rejects(text):
    with pytest.raises(ConvertError, match="--size"):
        plan.parse_size(text)


def test_budget_helpers():
    assert plan.budget_for_bpw(4.0, 1000) == 500
    with pytest.raises(ConvertError, match="--bpw"):
        plan.budget_for_bpw(0, 1000)
    assert plan.budget_for_size(10_000, 1_000) == 9_000
    with pytest.raises(ConvertError, match="header"):
        plan.budget_for_size(1_000, 5_000)
    assert plan.budget_for_types({"a": "Q4_K", "n": "F32"}, {"a": 512, "n": 10}) == 288 + 40
