"""Pure helpers of the engine, and how its native libraries load."""

import ast
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from edgerun.runtime.engine import _common_prefix


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_common_prefix_matches_a_plain_scan(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert _common_prefix(a, b) == n


def test_the_native_extension_shares_llama_cpps_library():
    """Imported first, the extension must not bring a second libllama into the process (it did:
    llama-cpp-python opens libllama.so by path, the extension needs libllama.so.0, and the wheel
    ships them as two files). Two copies crashed a sampler made by one and run by the other."""
    script = ("import edgerun._native, llama_cpp\n"
              "maps = open('/proc/self/maps').read().splitlines()\n"
              "print(sorted({l.split()[-1] for l in maps if '/libllama' in l}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    libs = ast.literal_eval(out)
    assert len(libs) == 1, libs
