"""Pure helpers of the engine, and how its native libraries load."""

import ast
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from edgerun.runtime.engine import common_prefix


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def testcommon_prefix_matches_a_plain_scan(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix(a, b) == n


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


def test_llama_cpps_debug_lines_reach_python_only_when_asked_for(small_model, monkeypatch):
    """On a GPU ggml logs a debug line per decode step; each would be a GIL round trip inside the
    step. The native filter keeps debug lines out of Python unless the logger wants them, and
    passes the rest."""
    import logging

    from edgerun.runtime import llama_log
    from edgerun.runtime.engine import Context, Model
    from edgerun.settings import EngineSettings

    arrived: list[tuple[int, str]] = []  # (llama.cpp's level, text) of each call into Python

    class Recording(llama_log._LineBuffer):
        def feed(self, level: int, text: str) -> None:
            arrived.append((level, text))
            super().feed(level, text)

    monkeypatch.setattr(llama_log, "_buffer", Recording())
    log = logging.getLogger("edgerun.llama")

    def load_and_toggle_sampler() -> list[tuple[int, str]]:
        """A model load logs info lines; llama_set_sampler a debug line each time."""
        arrived.clear()
        with Model(small_model) as model, Context(model, EngineSettings(n_ctx=256)) as ctx:
            ctx.greedy_on_device(True)
            ctx.greedy_on_device(False)
        return list(arrived)

    level = log.level
    try:
        log.setLevel(logging.INFO)
        llama_log.install()
        quiet = load_and_toggle_sampler()
        assert any(lvl == 2 for lvl, _ in quiet)  # ggml's INFO
        assert not [text for lvl, text in quiet if lvl == 1]  # no DEBUG call reached Python

        log.setLevel(logging.DEBUG)
        llama_log.install()
        loud = load_and_toggle_sampler()
        assert any(lvl == 1 and "set_sampler: seq_id" in text for lvl, text in loud)
    finally:
        log.setLevel(level)
        llama_log.install()


def test_token_pieces_are_right_when_threads_ask_at_once(tiny_model):
    """The server's engine thread turns tokens into text while request threads render prompts
    (which ask for the BOS/EOS pieces): each call gets its own token's bytes. One shared result
    buffer let a request's '<|endoftext|>' overwrite the engine's ' o' between llama.cpp writing
    it and Python reading it, and a reply began with '<|'."""
    import threading

    from edgerun.runtime.engine import Model

    with Model(tiny_model) as reference:
        want = {(t, s): reference.piece(t, special=s) for t in range(reference.n_vocab) for s in (False, True)}
    wrong: list[tuple[int, bool, bytes]] = []
    with Model(tiny_model) as model:
        start = threading.Barrier(4)

        def ask(special: bool, step: int) -> None:
            start.wait()
            for _ in range(20):
                for t in range(0, model.n_vocab)[::step]:
                    if (got := model.piece(t, special=special)) != want[t, special]:
                        wrong.append((t, special, got))

        threads = [threading.Thread(target=ask, args=(s, d)) for s in (False, True) for d in (1, -1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not wrong, wrong[:5]
