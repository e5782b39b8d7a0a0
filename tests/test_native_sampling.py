"""The native sampling math (native/sampling.cpp) against its NumPy reference, plus the
statistical promises of speculative verification. No model needed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgerun import _native
from edgerun.decode import reference

SEEDS = [0, 1, 42, 2**32 - 1, 2**32, 2**63, 2**64 - 1]

# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


# ---------------------------------------------------------------- helpers

def make_params(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64):
    """The same settings as a native SamplerParams and as the reference's keyword dict."""
    native = _native.SamplerParams()
    native.temperature = temperature
    native.top_k = top_k
    native.top_p = top_p
    native.min_p = min_p
    native.repeat_penalty = repeat_penalty
    native.repeat_last_n = repeat_last_n
    ref = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
               repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n)
    return native, ref


def random_logits(gen: np.random.Generator, n: int, scale: float = 3.0) -> np.ndarray:
    return (gen.standard_normal(n) * scale).astype(np.float32)


def random_history(gen: np.random.Generator, vocab: int, length: int | None = None) -> list[int]:
    length = int(gen.integers(0, 100)) if length is None else length
    return [int(t) for t in gen.integers(0, vocab, size=length)]


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------- Rng

@pytest.mark.parametrize("seed", SEEDS)
def test_rng_next_sequences_match(seed):
    a, b = _native.Rng(seed), reference.Rng(seed)
    assert [a.next() for _ in range(2000)] == [b.next() for _ in range(2000)]


@pytest.mark.parametrize("seed", SEEDS)
def test_rng_uniform_sequences_match(seed):
    a, b = _native.Rng(seed), reference.Rng(seed)
    ua = [a.uniform() for _ in range(2000)]
    assert ua == [b.uniform() for _ in range(2000)]
    assert all(0.0 <= u < 1.0 for u in ua)


@given(st.integers(0, 2**64 - 1))
@settings(max_examples=200, deadline=None)
def test_rng_matches_for_any_seed(seed):
    a, b = _native.Rng(seed), reference.Rng(seed)
    assert [a.next() for _ in range(8)] == [b.next() for _ in range(8)]
    assert a.uniform() == b.uniform()


def test_rng_seeds_give_different_streams():
    firsts = {_native.Rng(s).next() for s in SEEDS}
    assert len(firsts) == len(SEEDS)


# ---------------------------------------------------------------- distribution

def assert_same_distribution(logits, history, native_params, ref_params):
    got = _native.distribution(logits, history, native_params)
    want = reference.distribution(logits, history, **ref_params)
    assert got.dtype == np.float32 and got.shape == logits.shape
    np.testing.assert_array_equal(got == 0, want == 0)  # identical support
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert abs(float(got.astype(np.float64).sum()) - 1.0) < 1e-5
    assert (got >= 0).all()
    return got


@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([50, 1000]),
    scale=st.sampled_from([0.5, 3.0, 8.0]),
    temperature=st.floats(0.3, 2.0),
    top_k=st.sampled_from([0, 1, 5, 40]),
    top_p=st.one_of(st.just(1.0), st.floats(0.5, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.2)),
    repeat_penalty=st.sampled_from([1.0, 1.3]),
    repeat_last_n=st.sampled_from([64, 0, -1, 8]),
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_distribution_matches_reference(seed, vocab, scale, temperature, top_k, top_p, min_p, repeat_penalty,
                                        repeat_last_n):
    gen = np.random.default_rng(seed)
    logits = random_logits(gen, vocab, scale)
    history = random_history(gen, vocab)
    native, ref = make_params(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n)
    got = assert_same_distribution(logits, history, native, ref)
    if top_k > 0:
        assert np.count_nonzero(got) <= top_k


@pytest.mark.parametrize("top_k,top_p,min_p,repeat_penalty", [
    (0, 1.0, 0.0, 1.0), (40, 0.95, 0.05, 1.0), (0, 0.9, 0.0, 1.3), (5, 0.5, 0.2, 1.3), (1, 1.0, 0.0, 1.0),
    (0, 1.0, 0.1, 1.3),
])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_distribution_matches_reference_large_vocab(temperature, top_k, top_p, min_p, repeat_penalty):
    gen = np.random.default_rng(hash((temperature, top_k, top_p, min_p, repeat_penalty)) & 0xFFFFFFFF)
    logits = random_logits(gen, 32000, 2.0)
    history = random_history(gen, 32000, 200)
    native, ref = make_params(temperature, top_k, top_p, min_p, repeat_penalty)
    assert_same_distribution(logits, history, native, ref)


@pytest.mark.parametrize("top_k", [0, 3, 7])
def test_distribution_ties_break_toward_lower_ids(top_k):
    # many equal logits: top-k and the support must pick the same (lowest) ids in both
    logits = np.array([1, 3, 3, 0, 3, 2, 3, 3, 1, 3], dtype=np.float32)
    native, ref = make_params(1.0, top_k, 1.0, 0.0)
    got = assert_same_distribution(logits, [], native, ref)
    if top_k == 3:
        assert list(np.flatnonzero(got)) == [1, 2, 4]


def test_distribution_top_k_one_is_a_point_mass():
    logits = np.array([0.5, 2.0, -1.0, 1.9], dtype=np.float32)
    native, _ = make_params(1.5, 1, 1.0, 0.0)
    np.testing.assert_array_equal(_native.distribution(logits, [], native), [0, 1, 0, 0])


def test_float_settings_round_like_the_native_params():
    # Four equal logits give cumulative probabilities exactly 0.25, 0.5, 0.75, 1. The native
    # SamplerParams stores top_p as float32: 0.750000001 becomes 0.75, so the cut keeps 3 tokens.
    # A reference comparing against the double 0.750000001 would keep all 4.
    logits = np.zeros(4, dtype=np.float32)
    native, ref = make_params(1.0, 0, 0.750000001, 0.0)
    got = assert_same_distribution(logits, [], native, ref)
    assert np.count_nonzero(got) == 3


def test_repeat_penalty_lowers_seen_tokens():
    logits = np.array([2.0, 2.0, -1.0, -1.0], dtype=np.float32)
    native, ref = make_params(1.0, 0, 1.0, 0.0, repeat_penalty=1.5)
    got = assert_same_distribution(logits, [0, 2], native, ref)
    assert got[0] < got[1] and got[2] < got[3]


# ---------------------------------------------------------------- sample_dense

@given(seed=st.integers(0, 2**32 - 1), vocab=st.integers(1, 300), zero_frac=st.floats(0.0, 0.95),
       u=st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.just(0.0), st.just(1.0 - 2.0**-53)))
@settings(max_examples=500, deadline=None)
def test_sample_dense_matches_reference(seed, vocab, zero_frac, u):
    gen = np.random.default_rng(seed)
    p = gen.random(vocab).astype(np.float32)
    p[gen.random(vocab) < zero_frac] = 0
    if not p.any():
        p[gen.integers(vocab)] = 1
    p /= p.sum()
    got = _native.sample_dense(p, u)
    assert got == reference.sample_dense(p, u)
    assert p[got] > 0


def test_sample_dense_inverse_cdf_edges():
    p = np.array([0, 0.25, 0, 0.5, 0.25, 0], dtype=np.float32)
    assert _native.sample_dense(p, 0.0) == 1
    assert _native.sample_dense(p, 0.2499) == 1
    assert _native.sample_dense(p, 0.25) == 3
    assert _native.sample_dense(p, 0.75) == 4
    assert _native.sample_dense(p, 1.0 - 2.0**-53) == 4  # never a zero-probability tail token


# ---------------------------------------------------------------- verify vs reference

def random_verify_case(gen: np.random.Generator, rule: str, q_mode: str, vocab: int):
    """rows, drafts, q (or None), history and params for one random verify call."""
    m = int(gen.integers(0, 6))
    rows = (gen.standard_normal((m + 1, vocab)) * gen.choice([1.0, 3.0])).astype(np.float32)
    temperature = float(gen.uniform(0.3, 2.0))
    top_k = int(gen.choice([0, 1, 5, 40]))
    top_p = float(gen.choice([1.0, gen.uniform(0.5, 1.0)]))
    min_p = float(gen.choice([0.0, gen.uniform(0.0, 0.2)]))
    repeat_penalty = float(gen.choice([1.0, 1.3]))
    native, ref = make_params(temperature, top_k, top_p, min_p, repeat_penalty)
    history = random_history(gen, vocab, int(gen.integers(0, 40)))
    q = None
    if q_mode == "dense":  # a full-support draft distribution
        q = gen.dirichlet(np.ones(vocab), size=m).astype(np.float32).reshape(m, vocab)
    elif q_mode == "filtered":  # a draft model's own filtered distribution (zeros included)
        draft_params = dict(ref, temperature=float(gen.uniform(0.5, 1.5)))
        q = np.array([reference.distribution(random_logits(gen, vocab), history, **draft_params)
                      for _ in range(m)], dtype=np.float32).reshape(m, vocab)
    drafts = []
    for i in range(m):
        if q is not None:
            qi = q[i].astype(np.float64)
            drafts.append(int(gen.choice(vocab, p=qi / qi.sum())))
        elif gen.random() < 0.6:  # an n-gram proposal that often agrees with the target
            drafts.append(int(np.argmax(rows[i])))
        else:
            drafts.append(int(gen.integers(vocab)))
    return rows, drafts, q, history, native, ref


@pytest.mark.parametrize("q_mode", ["dense", "filtered", "none"])
@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_verify_matches_reference(rule, q_mode):
    gen = np.random.default_rng([7, len(rule), len(q_mode)])
    n, same, accepted_any = 300, 0, 0
    for case in range(n):
        vocab = int(gen.choice([50, 200, 1000]))
        rows, drafts, q, history, native, ref = random_verify_case(gen, rule, q_mode, vocab)
        seed = int(gen.integers(0, 2**63))
        got = _native.verify(rows, drafts, q, history, native, rule, _native.Rng(seed))
        want = reference.verify(rows, drafts, q, history, ref, rule, reference.Rng(seed))
        same += got == want
        accepted_any += got[0] > 0
        assert 0 <= got[0] <= len(drafts) and 0 <= got[1] < vocab
    assert same >= 0.99 * n, f"{n - same} of {n} verdicts differ"
    assert accepted_any > 0  # the cases exercise acceptance, not only rejection


def long_verify_verdicts(cases: int = 12, reference_too: bool = True) -> tuple[list, int]:
    """The native verdicts of 64-draft n-gram rounds at T > 0 with a repeat penalty (each row's
    distribution depends on the drafts before it, so rows computed side by side must each get
    their own history), and how many equal the sequential reference's (0 without it)."""
    gen = np.random.default_rng(2026)
    verdicts, same = [], 0
    for _ in range(cases):
        vocab = int(gen.choice([20000, 40000]))  # rows go side by side from 16384 (a real model's vocabulary)
        rows = (gen.standard_normal((65, vocab)) * 2.0).astype(np.float32)
        drafts = [int(np.argmax(r)) for r in rows[:64]]
        for i, d in enumerate(drafts):
            rows[i, d] += float(gen.uniform(3.0, 12.0))  # most drafts held, some rejected on the way
        history = random_history(gen, vocab, 20) + drafts[:3]  # the penalty bites on repeats
        native, ref = make_params(float(gen.uniform(0.5, 1.2)), repeat_penalty=1.3)
        seed = int(gen.integers(0, 2**63))
        got = _native.verify(rows, drafts, None, history, native, "rejection", _native.Rng(seed))
        if reference_too:
            same += got == reference.verify(rows, drafts, None, history, ref, "rejection", reference.Rng(seed))
        verdicts.append(list(got))
    return verdicts, same


def test_long_verifies_at_t_above_0_judge_rows_computed_side_by_side_as_one_by_one():
    """The native verify computes a wave of rows' distributions on several threads (OpenMP's
    count, up to 8) and judges them in order: the verdicts are the same with this machine's
    threads, with one (row after row) and with eight whatever the machine (65 rows leave a last
    wave of one), and they are the NumPy reference's."""
    import json
    import os
    import subprocess
    import sys

    verdicts, same = long_verify_verdicts()
    assert same >= 0.95 * len(verdicts)
    assert sum(accepted > 8 for accepted, _ in verdicts) > len(verdicts) // 4  # rounds past a wave of 8
    assert any(accepted < 64 for accepted, _ in verdicts)
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_native_sampling import long_verify_verdicts;"
            " print(json.dumps(long_verify_verdicts(reference_too=False)[0]))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for threads in ("1", "8"):
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS=threads),
                             check=True, capture_output=True, text=True, cwd=root).stdout
        assert json.loads(out) == verdicts, f"OMP_NUM_THREADS={threads}"


@pytest.mark.parametrize("q_mode", ["dense", "none"])
@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_greedy_verify_matches_reference_exactly(rule, q_mode):
    gen = np.random.default_rng([11, len(rule), len(q_mode)])
    for _ in range(200):
        vocab = int(gen.choice([50, 1000]))
        rows, drafts, q, history, _, _ = random_verify_case(gen, rule, q_mode, vocab)
        native, ref = make_params(0.0, repeat_penalty=float(gen.choice([1.0, 1.3])))
        got = _native.verify(rows, drafts, q, history, native, rule, _native.Rng(1))
        assert got == reference.verify(rows, drafts, q, history, ref, rule, reference.Rng(1))


@given(seed=st.integers(0, 2**32 - 1), m=st.integers(0, 6), vocab=st.sampled_from([2, 5, 50]),
       agree=st.floats(0.0, 1.0))
@settings(max_examples=300, deadline=None)
def test_greedy_accepts_exactly_the_argmax_prefix(seed, m, vocab, agree):
    gen = np.random.default_rng(seed)
    rows = gen.standard_normal((m + 1, vocab)).astype(np.float32)
    best = rows.argmax(axis=1)
    drafts = [int(best[i]) if gen.random() < agree else int(gen.integers(vocab)) for i in range(m)]
    expected_accepted = next((i for i in range(m) if drafts[i] != best[i]), m)
    native, _ = make_params(0.0, repeat_penalty=1.0)
    for rule in ("rejection", "match"):
        accepted, nxt = _native.verify(rows, drafts, None, [], native, rule, _native.Rng(seed))
        assert accepted == expected_accepted
        assert nxt == best[accepted]  # the correction, or the bonus token after a full accept


def test_acceptance_compares_in_double_precision():
    # Two equal logits make p = [0.5, 0.5] exactly. Pick q(x) so that u * q(x) is just below 0.5
    # in double but rounds up to 0.5 in float32: native accepts (u < p/q); a reference that
    # multiplied in float32 would reject. Find such a seed deterministically.
    rows = np.zeros((2, 2), dtype=np.float32)
    native, ref = make_params(1.0, 0, 1.0, 0.0)
    for seed in range(10_000):
        u = reference.Rng(seed).uniform()
        if u <= 0.5:
            continue
        qx = np.float32(0.5 / u)
        if u * float(qx) < 0.5 and np.float32(u) * qx >= np.float32(0.5):
            break
    else:
        pytest.skip("no boundary seed found")
    q = np.array([[qx, 1 - qx]], dtype=np.float32)
    got = _native.verify(rows, [0], q, [], native, "rejection", _native.Rng(seed))
    assert got[0] == 1
    assert got == reference.verify(rows, [0], q, [], ref, "rejection", reference.Rng(seed))


# ---------------------------------------------------------------- distributional guarantees

P_LOGITS = np.array([2.0, 1.2, 0.6, 0.0, -0.4, -1.5], dtype=np.float32)
Q_DRAFT = np.array([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
TRIALS = 20_000


def target_probs() -> np.ndarray:
    _, ref = make_params(1.0, 0, 1.0, 0.0)
    return reference.distribution(P_LOGITS, [], **ref).astype(np.float64)


def first_tokens_native(rule: str, q: np.ndarray | None, drafts: np.ndarray, seed: int) -> np.ndarray:
    """The first committed token of each trial: the draft if accepted, else the correction."""
    native, _ = make_params(1.0, 0, 1.0, 0.0)
    rows = np.stack([P_LOGITS, P_LOGITS])
    q_rows = None if q is None else q.astype(np.float32)[None, :]
    rng = _native.Rng(seed)
    out = np.empty(len(drafts), dtype=np.int64)
    for i, x in enumerate(drafts):
        accepted, nxt = _native.verify(rows, [int(x)], q_rows, [], native, rule, rng)
        out[i] = x if accepted >= 1 else nxt
    return out


def first_tokens_broken_residual(p: np.ndarray, q: np.ndarray, drafts: np.ndarray,
                                 gen: np.random.Generator) -> np.ndarray:
    """Rejection sampling done wrong: after a rejection, resample from p instead of max(0, p - q)."""
    u = gen.random(len(drafts))
    accept = u * q[drafts] < p[drafts]
    resampled = gen.choice(len(p), size=len(drafts), p=p)
    return np.where(accept, drafts, resampled)


def test_rejection_rule_preserves_the_target_distribution():
    p = target_probs()
    gen = np.random.default_rng(2024)
    drafts = gen.choice(len(Q_DRAFT), size=TRIALS, p=Q_DRAFT)
    crit = CHI2_CRIT_001[len(p) - 1]

    good = np.bincount(first_tokens_native("rejection", Q_DRAFT, drafts, seed=5), minlength=len(p))
    assert chi_square(good, p) < crit

    # the same test rejects a broken residual, so it has the power to fail
    broken = np.bincount(first_tokens_broken_residual(p, Q_DRAFT, drafts, gen), minlength=len(p))
    assert chi_square(broken, p) > crit


def test_point_mass_drafts_preserve_the_target_distribution():
    # an n-gram drafter always proposes the same token: q(x) = 1, the output must still be ~ p
    p = target_probs()
    crit = CHI2_CRIT_001[len(p) - 1]
    for x, seed in [(0, 1), (4, 2)]:
        out = first_tokens_native("rejection", None, np.full(TRIALS // 2, x), seed=seed)
        assert chi_square(np.bincount(out, minlength=len(p)), p) < crit


def test_match_rule_preserves_the_target_distribution():
    p = target_probs()
    gen = np.random.default_rng(99)
    drafts = gen.choice(len(Q_DRAFT), size=TRIALS, p=Q_DRAFT)
    out = first_tokens_native("match", Q_DRAFT, drafts, seed=6)
    assert chi_square(np.bincount(out, minlength=len(p)), p) < CHI2_CRIT_001[len(p) - 1]


def test_rejection_accepts_more_often_than_match():
    p = target_probs()
    gen = np.random.default_rng(31)
    drafts = gen.choice(len(Q_DRAFT), size=TRIALS, p=Q_DRAFT)
    native, _ = make_params(1.0, 0, 1.0, 0.0)
    rows = np.stack([P_LOGITS, P_LOGITS])
    q_rows = Q_DRAFT.astype(np.float32)[None, :]
    rates = {}
    for rule in ("rejection", "match"):
        rng = _native.Rng(8)
        rates[rule] = np.mean([_native.verify(rows, [int(x)], q_rows, [], native, rule, rng)[0] for x in drafts])
    theory = {"rejection": np.minimum(p, Q_DRAFT).sum(), "match": (p * Q_DRAFT).sum()}
    for rule, rate in rates.items():
        se = np.sqrt(theory[rule] * (1 - theory[rule]) / TRIALS)
        assert abs(rate - theory[rule]) < 4 * se, (rule, rate, theory[rule])
    assert theory["rejection"] - theory["match"] > 10 * se  # the setup separates them
    assert rates["rejection"] > rates["match"]


# ---------------------------------------------------------------- bad arguments

def _rows(m: int, vocab: int = 10) -> np.ndarray:
    return np.zeros((m + 1, vocab), dtype=np.float32)


@pytest.mark.parametrize("call", [
    lambda p: _native.verify(_rows(1), [1], None, [], p, "bogus", _native.Rng(0)),
    lambda p: _native.verify(_rows(2), [1], None, [], p, "rejection", _native.Rng(0)),  # rows != drafts + 1
    lambda p: _native.verify(_rows(1)[0], [], None, [], p, "rejection", _native.Rng(0)),  # rows not 2-D
    lambda p: _native.verify(_rows(1), [10], None, [], p, "rejection", _native.Rng(0)),  # draft outside vocab
    lambda p: _native.verify(_rows(1), [-1], None, [], p, "match", _native.Rng(0)),
    lambda p: _native.verify(_rows(2), [1, 2], np.full((1, 10), 0.1, np.float32), [], p, "rejection",
                             _native.Rng(0)),  # fewer q rows than drafts
    lambda p: _native.distribution(np.zeros(0, np.float32), [], p),  # empty vocabulary
])
def test_bad_arguments_raise_value_error(call):
    native, _ = make_params(1.0)
    with pytest.raises(ValueError):
        call(native)


def test_distribution_refuses_greedy_params():
    native, _ = make_params(0.0)
    with pytest.raises(ValueError):
        _native.distribution(np.zeros(5, np.float32), [], native)


# ---------------------------------------------------------------- argmax and the draft's confidence

@pytest.mark.parametrize("n", [1, 5, 16, 17, 47, 1000, 151_936])
def test_argmax_returns_the_first_of_equal_maxima_wherever_they_sit(n):
    gen = np.random.default_rng(n)
    for _ in range(20):
        x = random_logits(gen, n)
        assert _native.argmax(x) == int(np.argmax(x))
        ties = np.sort(gen.choice(n, size=min(n, 3), replace=False))
        x[ties] = x.max() + 1.0  # equal maxima: the lowest index wins, as in NumPy
        assert _native.argmax(x) == ties[0]
    tail = np.zeros(n, dtype=np.float32)
    tail[-1] = 1.0  # past the last whole 16-block
    assert _native.argmax(tail) == n - 1


def _share(logits: np.ndarray, x: int) -> float:
    l = logits.astype(np.float64)
    return 1.0 / np.exp(l - l[x]).sum()


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_the_drafts_confidence_check_matches_the_softmax(scale):
    gen = np.random.default_rng(int(scale * 10))
    checked = {True: 0, False: 0}
    for _ in range(60):
        logits = random_logits(gen, int(gen.choice([50, 4096, 151_936])), scale)
        x = int(np.argmax(logits))
        if gen.random() < 0.5:  # a peaked row, as a confident draft gives
            logits[x] += float(gen.uniform(0, 25))
        p = _share(logits, x)
        for p_min in (0.05, 0.2, 0.5, 0.9):
            if abs(p - p_min) < 1e-9:
                continue
            got = _native.top_share_reaches(logits, x, p_min)
            assert got == (p >= p_min), (p, p_min)
            checked[got] += 1
    assert min(checked.values()) > 20  # both answers exercised


def test_the_confidence_check_is_exact_where_skipped_logits_decide_it():
    # The pick at 0 and 151,935 logits at -20.5: each one skipped as negligible, yet together they
    # take p(pick) to 0.99981. A bound that ignored them would answer yes to 0.9999.
    logits = np.full(151_936, -20.5, dtype=np.float32)
    logits[7] = 0.0
    p = _share(logits, 7)
    assert 0.9997 < p < 0.9999
    assert _native.top_share_reaches(logits, 7, 0.9997)
    assert not _native.top_share_reaches(logits, 7, 0.9999)
    assert _native.top_share_reaches(logits, 7, 0.0)


# ---------------------------------------------------------------- the repetition window

@pytest.mark.parametrize("last_n,expect", [(-1, [1, 2, 3, 4, 9]), (0, []), (1, [9]), (3, [3, 4, 9]), (64, [1, 2, 3, 4, 9])])
def test_the_penalty_window_means_what_llama_cpp_means(last_n, expect):
    from edgerun.settings import SamplerSettings

    s = SamplerSettings(repeat_penalty=1.3, repeat_last_n=last_n)
    assert s.penalty_window([1, 2, 3, 4], 9) == expect
    assert SamplerSettings(repeat_penalty=1.0, repeat_last_n=last_n).penalty_window([1, 2, 3, 4], 9) == []


@pytest.mark.parametrize("last_n", [-1, 0, 1, 6])
def test_the_repetition_window_of_a_whole_reply_on_the_real_sampler(tiny_model, last_n):
    """A strongly penalized greedy reply through the native round (plain stretches that extend
    the window themselves) equals a token-by-token loop on the same model that applies the
    reference penalty over the window llama.cpp means: the last N tokens, -1 all, 0 none."""
    from edgerun.decode.generate import Step, generate
    from edgerun.runtime.engine import Context, Model
    from edgerun.settings import EngineSettings, SamplerSettings

    sampling = SamplerSettings(temperature=0.0, repeat_penalty=4.0, repeat_last_n=last_n)
    with Model(tiny_model) as model, Context(model, EngineSettings(n_ctx=256, n_threads=1)) as ctx:
        prompt = model.tokenize("abab abab abab abab", add_special=False)
        got = [r.token for r in generate(ctx, prompt, sampling, max_tokens=40) if isinstance(r, Step)]
        ctx.trim(0)
        seq, want = list(prompt), []
        ctx.eval(seq)
        while len(want) < len(got):
            window = seq if last_n < 0 else seq[len(seq) - min(len(seq), last_n):] if last_n else []
            token = int(np.argmax(reference.apply_penalty(ctx.logits(-1), window, 4.0, last_n)))
            want.append(token)
            if model.is_eog(token):
                break
            seq.append(token)
            ctx.eval([token])
    assert got == want and len(got) > 20


def test_the_last_of_a_64_token_point_mass_draft_keeps_the_target_distribution():
    """The n-gram drafter's longest round: 63 drafts the target is all but sure of, then one at
    position 63 whose row is P_LOGITS. The token committed there, the draft if accepted or the
    correction, must follow p: acceptance math does not drift along a long draft."""
    long = 64
    sure = np.full(len(P_LOGITS), -30.0, dtype=np.float32)
    sure[2] = 30.0  # p(2) = 1 - 1e-26: accepted every time
    rows = np.stack([sure] * (long - 1) + [P_LOGITS, P_LOGITS])
    native, _ = make_params(1.0, 0, 1.0, 0.0)
    p = target_probs()
    for x, seed in [(0, 3), (4, 4)]:
        drafts = [2] * (long - 1) + [x]
        rng, out = _native.Rng(seed), np.empty(TRIALS // 2, dtype=np.int64)
        for i in range(len(out)):
            accepted, nxt = _native.verify(rows, drafts, None, [], native, "rejection", rng)
            assert accepted >= long - 1
            out[i] = x if accepted == long else nxt
        assert chi_square(np.bincount(out, minlength=len(p)), p) < CHI2_CRIT_001[len(p) - 1]
