#include "sampling.hpp"

#include "grammar.hpp"

#include <cstring>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_set>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace edgerun {

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

Rng::Rng(uint64_t seed) {
    for (auto& word : s_) {  // splitmix64 spreads any seed (even 0) over the whole state
        seed += 0x9E3779B97F4A7C15ull;
        uint64_t z = seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        word = z ^ (z >> 31);
    }
}

uint64_t Rng::next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

bool penalty_on(const SamplerParams& p) { return p.repeat_penalty != 1.0f && p.repeat_last_n != 0; }

void push_history(std::vector<int32_t>& history, int32_t token, const SamplerParams& p) {
    if (!penalty_on(p)) return;
    history.push_back(token);
    if (p.repeat_last_n > 0 && history.size() > static_cast<size_t>(p.repeat_last_n)) history.erase(history.begin());
}

void apply_penalty(float* logits, int n_vocab, const std::vector<int32_t>& history, const SamplerParams& p) {
    if (!penalty_on(p)) return;
    const size_t n = history.size();
    const size_t start = p.repeat_last_n < 0 ? 0 : n - std::min(n, static_cast<size_t>(p.repeat_last_n));
    std::unordered_set<int32_t> seen(history.begin() + start, history.end());
    for (int32_t t : seen) {
        if (t < 0 || t >= n_vocab) continue;
        logits[t] = logits[t] > 0 ? logits[t] / p.repeat_penalty : logits[t] * p.repeat_penalty;
    }
}

namespace {

typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

v4 load4(const float* x) {
    v4 v;
    std::memcpy(&v, x, sizeof v);
    return v;
}

bool any(v4i m) {
    uint64_t w[2];
    std::memcpy(w, &m, sizeof w);
    return (w[0] | w[1]) != 0;
}

// Whether any of x[i..i+16) satisfies x >= at (NaN never does).
bool block_reaches(const float* x, const v4 at) {
    return any((load4(x) >= at) | (load4(x + 4) >= at) | (load4(x + 8) >= at) | (load4(x + 12) >= at));
}

}  // namespace

int32_t argmax(const float* x, int n) {
    // Pass 1: four independent 4-wide running maxima (std::max_element's data-dependent branch ran
    // at ~3 ns per logit). Pass 2: the first 16-block holding the maximum, then its first index.
    // Both run at memory speed (~20 us for 151,936 logits vs up to ~120 us for a scalar second
    // pass), which matters when a GPU decode step takes about a millisecond.
    if (n <= 0) return 0;
    float best = x[0];
    int i = 0;
    if (n >= 16) {
        v4 m0 = load4(x), m1 = m0, m2 = m0, m3 = m0;
        for (; i + 16 <= n; i += 16) {
            const v4 a = load4(x + i), b = load4(x + i + 4), c = load4(x + i + 8), d = load4(x + i + 12);
            m0 = a > m0 ? a : m0;
            m1 = b > m1 ? b : m1;
            m2 = c > m2 ? c : m2;
            m3 = d > m3 ? d : m3;
        }
        m0 = m1 > m0 ? m1 : m0;
        m2 = m3 > m2 ? m3 : m2;
        m0 = m2 > m0 ? m2 : m0;
        for (int j = 0; j < 4; ++j) best = m0[j] > best ? m0[j] : best;
    }
    for (; i < n; ++i) best = x[i] > best ? x[i] : best;
    const v4 at = {best, best, best, best};
    int j = 0;
    while (j + 16 <= n && !block_reaches(x + j, at)) j += 16;
    for (; j < n; ++j)
        if (x[j] == best) return j;  // first of equal maxima
    return static_cast<int32_t>(std::max_element(x, x + n) - x);  // only NaNs: keep the old rule
}

bool top_share_reaches(const float* logits, int n, int32_t x, double p_min) {
    // p(x) >= p_min  <=>  z = sum_t exp(l_t - l_x) <= 1 / p_min. Terms more than SKIP below l_x
    // add under exp(-SKIP) each, so whole 16-blocks below that line are only counted, not
    // exponentiated: one vector compare per 16 logits instead of 16 double exps (~1 ms per draft
    // token at Qwen's vocabulary). Their count bounds what they add; only when that bound could
    // flip the answer (p(x) within ~1e-4 of p_min) is the full sum taken.
    if (p_min <= 0) return true;
    constexpr float SKIP = 20.0f;
    const double limit = 1.0 / p_min;
    const float top = logits[x];
    const float cut = top - SKIP;
    const v4 at = {cut, cut, cut, cut};
    double z = 0;
    long skipped = 0;
    int t = 0;
    auto add = [&](int from, int to) {
        for (int u = from; u < to; ++u) {
            if (logits[u] >= cut) z += std::exp(static_cast<double>(logits[u]) - top);
            else ++skipped;
        }
    };
    for (; t + 16 <= n; t += 16) {
        if (!block_reaches(logits + t, at)) {
            skipped += 16;
            continue;
        }
        add(t, t + 16);
        if (z > limit) return false;  // z only grows
    }
    add(t, n);
    if (z > limit) return false;
    if (z + static_cast<double>(skipped) * std::exp(-static_cast<double>(SKIP)) <= limit) return true;
    double full = 0;  // on the edge: the exact sum
    for (int u = 0; u < n; ++u) full += std::exp(static_cast<double>(logits[u]) - top);
    return full <= limit;
}

bool penalty_active(const std::vector<int32_t>& history, const SamplerParams& p) {
    return penalty_on(p) && !history.empty();
}

int32_t greedy_pick(const float* logits, int n_vocab, const std::vector<int32_t>& history, const SamplerParams& p) {
    if (!penalty_active(history, p)) return argmax(logits, n_vocab);  // no copy of the row
    std::vector<float> row(logits, logits + n_vocab);
    apply_penalty(row.data(), n_vocab, history, p);
    return argmax(row.data(), n_vocab);
}

void distribution(const float* logits, int n_vocab, const std::vector<int32_t>& history,
                  const SamplerParams& p, std::vector<float>& out) {
    if (n_vocab <= 0) throw std::invalid_argument("distribution needs at least one logit");
    std::vector<float> copy;
    const float* l = logits;
    if (penalty_active(history, p)) {
        copy.assign(logits, logits + n_vocab);
        apply_penalty(copy.data(), n_vocab, history, p);
        l = copy.data();
    }

    // candidates sorted by logit, descending (ties: lower id first), cut to top_k
    auto by_logit = [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
    std::vector<int32_t> idx;
    size_t keep;
    if (p.top_k > 0 && p.top_k < n_vocab) {
        // a heap of the k best so far, its worst in front: most logits cost one comparison
        keep = static_cast<size_t>(p.top_k);
        idx.resize(keep);
        std::iota(idx.begin(), idx.end(), 0);
        std::make_heap(idx.begin(), idx.end(), by_logit);
        for (int32_t t = static_cast<int32_t>(keep); t < n_vocab; ++t) {
            if (!by_logit(t, idx.front())) continue;
            std::pop_heap(idx.begin(), idx.end(), by_logit);
            idx.back() = t;
            std::push_heap(idx.begin(), idx.end(), by_logit);
        }
        std::sort_heap(idx.begin(), idx.end(), by_logit);
    } else {
        idx.resize(n_vocab);
        std::iota(idx.begin(), idx.end(), 0);
        std::sort(idx.begin(), idx.end(), by_logit);
        keep = idx.size();
    }

    // softmax at temperature 1 over the candidates, for top-p and min-p
    std::vector<double> prob(keep);
    const double top = l[idx[0]];
    double sum = 0;
    for (size_t i = 0; i < keep; ++i) sum += prob[i] = std::exp(static_cast<double>(l[idx[i]]) - top);
    if (p.top_p < 1.0f) {
        double cum = 0;
        size_t cut = keep;
        for (size_t i = 0; i < keep; ++i) {
            cum += prob[i] / sum;
            if (cum >= p.top_p) { cut = i + 1; break; }
        }
        keep = cut;
    }
    if (p.min_p > 0.0f) {
        // prob[0] is the largest; keep those at least min_p times as likely
        size_t cut = 1;
        while (cut < keep && prob[cut] >= p.min_p * prob[0]) ++cut;
        keep = cut;
    }

    // temperature over the survivors
    out.assign(n_vocab, 0.0f);
    double z = 0;
    std::vector<double> w(keep);
    for (size_t i = 0; i < keep; ++i) z += w[i] = std::exp((static_cast<double>(l[idx[i]]) - top) / p.temperature);
    for (size_t i = 0; i < keep; ++i) out[idx[i]] = static_cast<float>(w[i] / z);
}

int32_t sample_dense(const std::vector<float>& probs, double u) {
    double total = 0;
    for (float v : probs) total += v;
    const double target = u * total;
    double cum = 0;
    int32_t last = -1;
    for (size_t i = 0; i < probs.size(); ++i) {
        if (probs[i] <= 0) continue;
        cum += probs[i];
        last = static_cast<int32_t>(i);
        if (target < cum) return last;
    }
    return last;  // rounding left u*total at the very end
}

// verify indexes pdist[x], q[i][x] and rows[i] directly; the Python face passes caller data
// through, so a bad shape or token must be refused here rather than read out of bounds.
static void check_verify_args(const std::vector<const float*>& rows, int n_vocab, const std::vector<int32_t>& drafts,
                              const std::vector<std::vector<float>>& q) {
    if (n_vocab <= 0) throw std::invalid_argument("verify needs n_vocab > 0");
    if (rows.size() != drafts.size() + 1) throw std::invalid_argument("verify needs len(drafts) + 1 rows");
    if (!q.empty() && q.size() != drafts.size()) throw std::invalid_argument("q needs one row per draft");
    for (const auto& row : q)
        if (row.size() != static_cast<size_t>(n_vocab)) throw std::invalid_argument("q rows need n_vocab entries");
    for (int32_t x : drafts)
        if (x < 0 || x >= n_vocab) throw std::invalid_argument("draft token outside the vocabulary");
}

namespace {

// Most rows whose distributions one verify computes side by side (see Wave): OpenMP's thread
// count (OMP_NUM_THREADS, else the cores) up to this; one where the build has no OpenMP.
constexpr int VERIFY_LANES = 8;
// ... for vocabularies at least this large: below, a row costs less than handing it to a thread
constexpr int VERIFY_LANES_FROM_VOCAB = 16384;

int openmp_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

// The target's distributions of a verify's rows, computed a wave of rows at a time on several
// threads and then judged in order. A row's distribution depends only on its logits and the
// history before it (the drafts ahead of it, all accepted if the row is reached), so the result is
// the sequential one. One row is a pass over the vocabulary (about 0.3 ms for Qwen's 151936 on the
// 2-core CPU, where a 64-draft verify at T=0.7 with every draft accepted took 15-21 ms judging one
// row after another), while a GPU verifies the batch in a few milliseconds: on an H100 a code edit
// at T=0.7 went from 1.23x to 1.71x prompt lookup at its best setting. A wave stops being useful
// where a draft is rejected; the next starts at the row reached.
class Wave {
public:
    Wave(const std::vector<const float*>& rows, int n_vocab, const std::vector<int32_t>& drafts,
         const SamplerParams& p)
        : rows_(rows), n_vocab_(n_vocab), drafts_(drafts), p_(p),
          lanes_(n_vocab < VERIFY_LANES_FROM_VOCAB
                     ? 1
                     : std::max(1, std::min({VERIFY_LANES, openmp_threads(),
                                             static_cast<int>(rows.size())}))) {}

    // Row i's distribution, with `history` the history before it: computed here with one lane,
    // else taken from the wave, which is computed anew from i on when row i is past it.
    void take(size_t i, const std::vector<int32_t>& history, std::vector<float>& out) {
        if (lanes_ == 1) return distribution(rows_[i], n_vocab_, history, p_, out);
        if (i < from_ || i >= from_ + dists_.size()) fill(i, history);
        out.swap(dists_[i - from_]);
    }

private:
    void fill(size_t i, const std::vector<int32_t>& history) {
        const int n = static_cast<int>(std::min<size_t>(lanes_, rows_.size() - i));
        std::vector<std::vector<int32_t>> hist{history};
        for (int j = 1; j < n; ++j) {
            hist.push_back(hist.back());
            push_history(hist.back(), drafts_[i + j - 1], p_);
        }
        from_ = i;
        dists_.resize(n);
        std::vector<std::string> errors(n);
#ifdef _OPENMP
        #pragma omp parallel for num_threads(n) schedule(static, 1)
#endif
        for (int j = 0; j < n; ++j) {
            try {
                distribution(rows_[i + j], n_vocab_, hist[j], p_, dists_[j]);
            } catch (const std::exception& e) {
                errors[j] = e.what();  // an exception must not leave an OpenMP region
            }
        }
        for (const auto& e : errors)
            if (!e.empty()) throw std::invalid_argument(e);
    }

    const std::vector<const float*>& rows_;
    const int n_vocab_;
    const std::vector<int32_t>& drafts_;
    const SamplerParams& p_;
    const int lanes_;
    size_t from_ = 0;
    std::vector<std::vector<float>> dists_;
};

}  // namespace

Verdict verify(const std::vector<const float*>& rows, int n_vocab, const std::vector<int32_t>& drafts,
               const std::vector<std::vector<float>>& q, std::vector<int32_t> history,
               const SamplerParams& p, AcceptRule rule, Rng& rng, Grammar* g) {
    check_verify_args(rows, n_vocab, drafts, q);
    Verdict v;
    std::vector<float> pdist;
    Wave wave(rows, n_vocab, drafts, p);  // without a grammar, whose state moves row by row
    for (size_t i = 0; i <= drafts.size(); ++i) {
        const bool bonus = i == drafts.size();
        if (p.greedy()) {
            const int32_t best = g ? masked_greedy(rows[i], n_vocab, history, p, *g)
                                   : greedy_pick(rows[i], n_vocab, history, p);
            if (bonus || best != drafts[i]) { v.next = best; return v; }
        } else {
            if (g) masked_distribution(rows[i], n_vocab, history, p, *g, pdist);
            else wave.take(i, history, pdist);
            if (bonus) { v.next = sample_dense(pdist, rng.uniform()); return v; }
            const int32_t x = drafts[i];
            const bool point_mass = q.empty();
            const double qx = point_mass ? 1.0 : q[i][x];
            const double u = rng.uniform();
            if (rule == AcceptRule::Match) {
                const int32_t y = sample_dense(pdist, u);
                if (y != x) { v.next = y; return v; }
            } else if (!(u * qx < pdist[x])) {
                // rejected: accept with min(1, p/q) failed; draw from max(0, p - q) normalized
                std::vector<float> residual(n_vocab);
                double mass = 0;
                for (int t = 0; t < n_vocab; ++t) {
                    const float qt = point_mass ? (t == x ? 1.0f : 0.0f) : q[i][t];
                    mass += residual[t] = std::max(0.0f, pdist[t] - qt);
                }
                v.next = sample_dense(mass > 0 ? residual : pdist, rng.uniform());
                return v;
            }
        }
        ++v.accepted;
        if (g) g->accept_allowed(drafts[i]);  // accepted => p(x) > 0 => the grammar allows it
        push_history(history, drafts[i], p);
    }
    return v;  // unreachable: the bonus row always returns
}

}  // namespace edgerun
