"""Sampler settings -> llama.cpp chain (pure part)."""

from edgerun.decode.sampling import chain_spec
from edgerun.settings import SamplerSettings


def test_greedy_chain():
    assert chain_spec(SamplerSettings(temperature=0)) == [("greedy", ())]


def test_full_chain_order_and_seed():
    spec = chain_spec(SamplerSettings(temperature=0.8, top_k=20, top_p=0.9, min_p=0.1, repeat_penalty=1.1, seed=7))
    assert [name for name, _ in spec] == ["penalties", "top_k", "top_p", "min_p", "temp", "dist"]
    assert spec[-1] == ("dist", (7,))


def test_disabled_filters_are_left_out():
    spec = chain_spec(SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    assert [name for name, _ in spec] == ["temp", "dist"]
