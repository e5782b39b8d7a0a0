#include "grammar.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace edgerun {

Grammar::Grammar(const llama_vocab* vocab, const std::string& gbnf, const std::string& root,
                 const std::vector<std::string>& trigger_patterns)
    : vocab_(vocab) {
    if (!vocab) throw std::invalid_argument("the grammar needs a model's vocabulary");
    if (gbnf.empty()) throw std::invalid_argument("the grammar is empty");
    if (trigger_patterns.empty()) {
        s_ = llama_sampler_init_grammar(vocab, gbnf.c_str(), root.c_str());
    } else {
        std::vector<const char*> patterns;
        for (const auto& t : trigger_patterns) patterns.push_back(t.c_str());
        s_ = llama_sampler_init_grammar_lazy_patterns(vocab, gbnf.c_str(), root.c_str(), patterns.data(),
                                                      patterns.size(), nullptr, 0);
    }
    if (!s_) throw std::invalid_argument("llama.cpp could not parse the grammar");
}

Grammar::Grammar(const Grammar& other) : s_(llama_sampler_clone(other.s_)), vocab_(other.vocab_) {
    if (!s_) throw std::runtime_error("could not copy the grammar's state");
}

Grammar::~Grammar() {
    if (s_) llama_sampler_free(s_);
}

void Grammar::filter(std::vector<int32_t>& ids) {
    if (ids.empty()) return;
    buf_.resize(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) buf_[i] = {ids[i], 0.0f, 0.0f};
    llama_token_data_array arr{buf_.data(), buf_.size(), -1, false};
    llama_sampler_apply(s_, &arr);  // refused candidates get a logit of -inf, in place
    size_t kept = 0;
    for (size_t i = 0; i < arr.size; ++i)
        if (!std::isinf(arr.data[i].logit)) ids[kept++] = arr.data[i].id;
    ids.resize(kept);
}

bool Grammar::allows(llama_token token) {
    std::vector<int32_t> one{token};
    filter(one);
    return !one.empty();
}

void Grammar::accept(llama_token token) {
    if (!allows(token)) throw std::invalid_argument("the grammar does not allow token " + std::to_string(token));
    llama_sampler_accept(s_, token);
}

namespace {

// Ids ordered by (logit descending, id ascending): the first allowed one is the masked argmax.
std::vector<int32_t> best_ids(const float* l, int n_vocab, size_t n) {
    auto by_logit = [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
    std::vector<int32_t> idx(n_vocab);
    std::iota(idx.begin(), idx.end(), 0);
    n = std::min(n, idx.size());
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), by_logit);
    idx.resize(n);
    return idx;
}

}  // namespace

int32_t masked_greedy(const float* logits, int n_vocab, const std::vector<int32_t>& history,
                      const SamplerParams& p, Grammar& g) {
    std::vector<float> row;
    const float* l = logits;
    if (penalty_on(p) && !history.empty()) {
        row.assign(logits, logits + n_vocab);
        apply_penalty(row.data(), n_vocab, history, p);
        l = row.data();
    }
    const int32_t best = argmax(l, n_vocab);
    if (g.allows(best)) return best;  // the usual case: the model already follows the grammar
    for (size_t n : {size_t(64), static_cast<size_t>(n_vocab)}) {
        std::vector<int32_t> ids = best_ids(l, n_vocab, n);
        g.filter(ids);  // keeps the order, so the first survivor is the best allowed
        if (!ids.empty()) return ids.front();
    }
    throw std::runtime_error("the grammar allows no token here");
}

void masked_distribution(const float* logits, int n_vocab, const std::vector<int32_t>& history,
                         const SamplerParams& p, Grammar& g, std::vector<float>& out) {
    distribution(logits, n_vocab, history, p, out);
    std::vector<int32_t> kept;
    for (int t = 0; t < n_vocab; ++t)
        if (out[t] > 0) kept.push_back(t);
    std::vector<int32_t> allowed = kept;
    g.filter(allowed);
    if (!allowed.empty()) {
        // the chain's distribution restricted to the allowed survivors, renormalized
        double mass = 0;
        for (int32_t t : allowed) mass += out[t];
        std::vector<float> masked(n_vocab, 0.0f);
        for (int32_t t : allowed) masked[t] = static_cast<float>(out[t] / mass);
        out.swap(masked);
        return;
    }
    // no survivor allowed: the chain over the allowed tokens among the best M candidates (by
    // penalized logit), M the first of 64, 4096 and the whole vocabulary that holds one. A pass of
    // the grammar over the whole vocabulary costs milliseconds; the model's best few almost
    // always hold an allowed token (a refused newline's indentation, say, after a space).
    std::vector<float> pen(logits, logits + n_vocab);
    const bool penalized = penalty_on(p) && !history.empty();
    if (penalized) apply_penalty(pen.data(), n_vocab, history, p);
    for (size_t m : {size_t(64), size_t(4096), static_cast<size_t>(n_vocab)}) {
        std::vector<int32_t> ids = best_ids(pen.data(), n_vocab, m);
        g.filter(ids);
        if (ids.empty() && m < static_cast<size_t>(n_vocab)) continue;
        if (ids.empty()) throw std::runtime_error("the grammar allows no token here");
        std::vector<float> row(n_vocab, -INFINITY);
        for (int32_t t : ids) row[t] = pen[t];
        SamplerParams once = p;  // the penalty is in the row already
        once.repeat_penalty = 1.0f;
        distribution(row.data(), n_vocab, {}, once, out);
        return;
    }
}

}  // namespace edgerun
