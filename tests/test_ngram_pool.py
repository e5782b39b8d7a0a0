"""The n-gram pool on disk (edgerun/ngram_pool.py): what one conversation leaves there, a later
one drafts from, with the reply unchanged; a damaged or unwritable pool costs nothing else."""

from __future__ import annotations

import os

import numpy as np

from edgerun.chat import ChatSession
from edgerun.decode.generate import Step
from edgerun.decode.speculative import Round
from edgerun.history import History
from edgerun.ngram_pool import PoolFile, clear
from edgerun.runner import Runner
from edgerun.settings import EngineSettings, SamplerSettings

GREEDY = SamplerSettings(temperature=0.0)
ENGINE = EngineSettings(n_ctx=1024, n_batch=64, n_threads=1, gpu_layers="0")
ASK = "Write the parser again, please."
N = 48


def test_a_pool_file_round_trips(tiny_model, tmp_path):
    pool = PoolFile(tiny_model, n_vocab=300, root=tmp_path)
    assert len(pool.pool) == 0  # none yet: an empty pool
    assert pool.remember([1, 2, 3, 4]) is None
    assert pool.remember([5, 6]) is None
    again = PoolFile(tiny_model, n_vocab=300, root=tmp_path)
    assert again.pool.tokens == pool.pool.tokens
    assert [p.name for p in tmp_path.iterdir()] == [pool.path.name]  # no temporary file left
    assert clear(tmp_path) == 1 and not pool.path.exists()


def test_a_damaged_pool_keeps_only_token_ids_of_the_model(tiny_model, tmp_path):
    pool = PoolFile(tiny_model, n_vocab=300, root=tmp_path)
    pool.remember([1, 2, 3])
    pool.remember([4, 5])
    good = pool.path.read_bytes()
    ids = np.frombuffer(os.urandom(4000), dtype="<i4")
    pool.path.write_bytes(good + ids.tobytes() + b"\x07")  # then ids mostly out of range, a torn last one
    loaded = PoolFile(tiny_model, n_vocab=300, root=tmp_path).pool
    assert loaded.tokens[:6] == [-1, 1, 2, 3, -1, 4] and all(t == -1 or 0 <= t < 300 for t in loaded.tokens)
    kept = [t for t in loaded.tokens if t != -1]
    assert kept == [1, 2, 3, 4, 5] + [t for t in ids.tolist() if 0 <= t < 300]


def test_an_unwritable_pool_is_a_reason_not_an_error(tiny_model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    pool = PoolFile(tiny_model, n_vocab=300, root=blocker)
    reason = pool.remember([1, 2, 3])
    assert reason and reason.startswith("the n-gram pool was not saved") and "\n" not in reason
    assert pool.pool.tokens[-3:] == [1, 2, 3]  # the pool in memory has them anyway


def _answer(model, history, pool_root) -> tuple[list[int], int]:
    """A fresh conversation asking ASK with the n-gram drafter: the reply and the drafts accepted."""
    with Runner(model, ENGINE, ngram=True, spec_k=8) as runner:
        pool = PoolFile(model, runner.model.n_vocab, root=pool_root) if pool_root else None
        session = ChatSession(runner, history, model_name="tiny", pool=pool)
        records = list(session.reply(ASK, GREEDY, max_tokens=N, cancel=None))
    tokens = [r.token for r in records if isinstance(r, Step) and r.finish != "stop"]
    return tokens, sum(r.accepted for r in records if isinstance(r, Round))


def test_a_new_conversation_drafts_from_an_earlier_one_and_replies_the_same(tiny_model, tmp_path):
    with History(tmp_path / "h.sqlite3") as history:
        alone, accepted_alone = _answer(tiny_model, history, None)
        first, _ = _answer(tiny_model, history, tmp_path / "pool")  # leaves its conversation in the pool
        second, accepted_pooled = _answer(tiny_model, history, tmp_path / "pool")
    assert first == alone and second == alone  # exact at T=0 with or without the pool
    # the earlier reply copied in drafts of 8: every token but one per round of 9 is a draft's
    assert accepted_pooled >= len(alone) * 8 // 9 - 1 > accepted_alone, (accepted_pooled, accepted_alone)
