"""Pure helpers of the engine."""

from hypothesis import given
from hypothesis import strategies as st

from edgerun.runtime.engine import _common_prefix


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_common_prefix_matches_a_plain_scan(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert _common_prefix(a, b) == n
