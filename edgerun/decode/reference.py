"""NumPy reference of the native sampling math (native/sampling.cpp), step for step.

Slow and obvious on purpose: tests check the native code against it on random logits."""

from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1


class Rng:
    """xoshiro256** seeded through splitmix64, as in native/sampling.cpp."""

    def __init__(self, seed: int):
        self.s = []
        for _ in range(4):
            seed = (seed + 0x9E3779B97F4A7C15) & _M64
            z = seed
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
            self.s.append(z ^ (z >> 31))

    @staticmethod
    def _rotl(x: int, k: int) -> int:
        return ((x << k) | (x >> (64 - k))) & _M64

    def next(self) -> int:
        s = self.s
        result = (self._rotl((s[1] * 5) & _M64, 7) * 9) & _M64
        t = (s[1] << 17) & _M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = self._rotl(s[3], 45)
        return result

    def uniform(self) -> float:
        return (self.next() >> 11) * 2.0**-53


def apply_penalty(logits: np.ndarray, history, penalty: float, last_n: int) -> np.ndarray:
    out = logits.astype(np.float32).copy()
    if penalty == 1.0 or last_n == 0:
        return out
    window = history if last_n < 0 else history[len(history) - min(len(history), last_n):]
    for t in set(window):
        if 0 <= t < len(out):
            out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def _f32(x: float) -> float:
    """A setting as SamplerParams stores it: float32. Cut-offs compare against this value (top_p
    0.9999999999999999 is 1.0f there, i.e. off), so the reference must round the same way."""
    return float(np.float32(x))


def distribution(logits, history, *, temperature, top_k, top_p, min_p, repeat_penalty=1.0, repeat_last_n=64):
    """Penalty, top-k, top-p and min-p on the T=1 softmax, then temperature over the survivors."""
    temperature, top_p, min_p, repeat_penalty = map(_f32, (temperature, top_p, min_p, repeat_penalty))
    l = apply_penalty(np.asarray(logits), history, repeat_penalty, repeat_last_n).astype(np.float64)
    n = len(l)
    order = np.argsort(-l, kind="stable")  # descending, lower id first on ties
    keep = top_k if 0 < top_k < n else n
    order = order[:keep]
    top = l[order[0]]
    prob = np.exp(l[order] - top)
    if top_p < 1.0:
        cum = np.cumsum(prob / prob.sum())
        keep = int(np.argmax(cum >= top_p)) + 1 if (cum >= top_p).any() else keep
    if min_p > 0.0:
        cut = 1
        while cut < keep and prob[cut] >= min_p * prob[0]:
            cut += 1
        keep = cut
    w = np.exp((l[order[:keep]] - top) / temperature)
    out = np.zeros(n, dtype=np.float32)
    out[order[:keep]] = w / w.sum()
    return out


def sample_dense(probs: np.ndarray, u: float) -> int:
    """Inverse CDF in token-id order."""
    nz = np.flatnonzero(probs > 0)
    cum = np.cumsum(probs[nz].astype(np.float64))
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return int(nz[min(i, len(nz) - 1)])


def verify(rows, drafts, q, history, params: dict, rule: str, rng: Rng) -> tuple[int, int]:
    """(accepted, next token) for a drafted run; q None means a point-mass (n-gram) drafter."""
    history = list(history)
    greedy = _f32(params["temperature"]) <= 0
    for i in range(len(drafts) + 1):
        bonus = i == len(drafts)
        if greedy:
            best = int(np.argmax(apply_penalty(rows[i], history, params["repeat_penalty"], params["repeat_last_n"])))
            if bonus or best != drafts[i]:
                return i, best
        else:
            p = distribution(rows[i], history, **params)
            if bonus:
                return i, sample_dense(p, rng.uniform())
            x = drafts[i]
            qrow = np.eye(1, len(p), x, dtype=np.float32)[0] if q is None else q[i]
            u = rng.uniform()
            if rule == "match":
                y = sample_dense(p, u)
                if y != x:
                    return i, y
            # in double, as native: u * np.float32 would round the product to float32 (NEP 50)
            elif not (u * float(qrow[x]) < float(p[x])):
                # accept with min(1, p/q) failed: draw from max(0, p - q) normalized
                residual = np.maximum(0.0, p - qrow)
                return i, sample_dense(residual if residual.sum() > 0 else p, rng.uniform())
        history.append(drafts[i])
    raise AssertionError("unreachable")
