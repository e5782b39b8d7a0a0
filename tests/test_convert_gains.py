"""Role gains: the pure parts (role names, probe types, weighing) without a model."""

from __future__ import annotations

import pytest

from edgerun.convert import gains
from edgerun.convert.sensitivity import TensorCost
from edgerun.errors import ConvertError


def cost(name: str, errors: dict[str, float], n: int = 256 * 256) -> TensorCost:
    return TensorCost(name=name, shape=(256, n // 256), n_elements=n, row_len=256, errors=errors)


def test_role_is_the_name_without_its_layer():
    assert gains.role_of("blk.12.attn_v.weight") == "attn_v.weight"
    assert gains.role_of("output.weight") == "output.weight"
    assert gains.role_of("token_embd.weight") == "token_embd.weight"


def test_probe_type_is_the_cheapest_candidate():
    assert gains.probe_type(cost("a", {"Q8_0": 1e-4, "Q2_K": 0.3, "Q4_K": 0.02})) == "Q2_K"
    # 32-blocks only (rows of 896): Q4_0 (4.5 bpw) is cheaper than Q4_1 (5) and Q8_0 (8.5)
    assert gains.probe_type(cost("b", {"Q8_0": 1e-4, "Q4_1": 0.01, "Q4_0": 0.02})) == "Q4_0"


def test_weigh_scales_each_role_and_keeps_the_order_within_it():
    costs = [cost("blk.0.attn_k.weight", {"Q2_K": 0.2, "Q4_K": 0.02}),
             cost("blk.1.attn_k.weight", {"Q2_K": 0.4, "Q4_K": 0.04}),
             cost("output.weight", {"Q2_K": 0.1, "Q6_K": 0.001})]
    weighed = gains.weigh(costs, {"attn_k.weight": 0.5, "output.weight": 20.0})
    assert weighed[0].errors == {"Q2_K": 0.1, "Q4_K": 0.01}
    assert weighed[1].errors == {"Q2_K": 0.2, "Q4_K": 0.02}
    assert weighed[2].errors == {"Q2_K": 2.0, "Q6_K": 0.02}
    assert [c.name for c in weighed] == [c.name for c in costs] and costs[0].errors["Q2_K"] == 0.2


def test_weigh_refuses_a_role_without_a_gain():
    with pytest.raises(ConvertError, match="no measured gain for output.weight"):
        gains.weigh([cost("output.weight", {"Q2_K": 0.1})], {"attn_k.weight": 1.0})
