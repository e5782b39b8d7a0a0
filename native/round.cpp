#include "round.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

namespace edgerun {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// RAII owner of a llama_batch for one sequence.
struct Batch {
    llama_batch b;
    explicit Batch(int n) : b(llama_batch_init(std::max(n, 1), 0, 1)) {}
    ~Batch() { llama_batch_free(b); }
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;

    void set(const std::vector<llama_token>& tokens, int pos0, int seq, bool all_logits) {
        b.n_tokens = static_cast<int32_t>(tokens.size());
        for (size_t i = 0; i < tokens.size(); ++i) {
            b.token[i] = tokens[i];
            b.pos[i] = pos0 + static_cast<int>(i);
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = seq;
            b.logits[i] = all_logits || i + 1 == tokens.size();
        }
    }
};

int n_vocab_of(llama_context* ctx) {
    return llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
}

// The draft's choice from its logits; sets `confident` false when its top probability < p_min.
// With a grammar the draft picks under it too (g: a copy, in the state before this draft).
llama_token draft_choice(const float* logits, int n_vocab, const std::vector<int32_t>& history,
                         const RoundPlan& in, Rng& rng, std::vector<float>& dist, bool& confident, Grammar* g) {
    if (in.params.greedy()) {
        const llama_token x = g ? masked_greedy(logits, n_vocab, history, in.params, *g)
                                : greedy_pick(logits, n_vocab, history, in.params);
        confident = top_share_reaches(logits, n_vocab, x, in.p_min);
        return x;
    }
    if (g) masked_distribution(logits, n_vocab, history, in.params, *g, dist);
    else distribution(logits, n_vocab, history, in.params, dist);
    confident = *std::max_element(dist.begin(), dist.end()) >= in.p_min;
    return sample_dense(dist, rng.uniform());
}

// Draft up to k tokens on the draft context. q gets the distribution of each (T > 0).
bool draft_tokens(const RoundPlan& in, Rng& rng, RoundResult& res, std::vector<std::vector<float>>& q) {
    const int n_vocab = n_vocab_of(in.draft);
    Batch batch(static_cast<int>(in.draft_feed.size()));
    int pos = in.draft_n_past;
    auto decode = [&](const std::vector<llama_token>& tokens) {
        batch.set(tokens, pos, in.seq, false);  // logits for the last token
        pos += static_cast<int>(tokens.size());
        if (llama_decode(in.draft, batch.b) == 0) return true;
        res.error = "draft llama_decode failed";
        return false;
    };
    res.draft.pos = in.draft_n_past;
    res.draft.kept = in.draft_feed;  // what it holds after the feed; decoded drafts follow
    if (in.stable_shapes) {
        for (llama_token t : in.draft_feed)
            if (!decode({t})) return false;
    } else if (!decode(in.draft_feed)) {
        return false;
    }
    std::vector<int32_t> history = in.history;
    std::vector<float> dist;
    std::unique_ptr<Grammar> g;  // the draft's own copy of the reply's grammar, advanced along its drafts
    if (in.grammar) g = std::make_unique<Grammar>(*in.grammar);
    while (static_cast<int>(res.drafts.size()) < in.k) {
        const float* logits = llama_get_logits_ith(in.draft, -1);
        if (!logits) { res.error = "draft produced no logits"; return false; }
        bool confident = true;
        const llama_token x = draft_choice(logits, n_vocab, history, in, rng, dist, confident, g.get());
        if (!confident) break;  // an unsure draft is likely rejected: verify what we have
        res.drafts.push_back(x);
        if (g) g->accept_allowed(x);  // a masked pick
        if (!in.params.greedy()) q.push_back(dist);
        push_history(history, x, in.params);
        // evaluate x only when another token will be drafted after it (or shapes must not change)
        if (static_cast<int>(res.drafts.size()) == in.k && !in.stable_shapes) break;
        if (!decode({x})) return false;
        res.draft.kept.push_back(x);  // in the draft's KV: its own proposal, not yet verified
    }
    return true;
}

// Decode `token` after what the round kept, without waiting for it: on a GPU it runs while the
// caller handles the round's tokens, and the next call (in_flight) starts from its result. Not
// an end-of-generation token: the reply ends there.
void leave_in_flight(const RoundPlan& in, Batch& batch, RoundResult& res, llama_token token) {
    if (llama_vocab_is_eog(llama_model_get_vocab(llama_get_model(in.target)), token)) return;
    batch.set({token}, in.target_n_past + static_cast<int>(res.target.kept.size()), in.seq, true);
    if (llama_decode(in.target, batch.b) != 0) { res.error = "target llama_decode failed"; return; }
    res.target.in_flight = true;
}

// Plain decoding without returning to Python: after `next`, keep decoding one token at a time
// until plain_steps tokens, an end-of-generation token, or the time budget. Python's per-token
// work (records, stats) is then paid once per call, which matters when a GPU step takes ~1 ms.
void plain_run(const RoundPlan& in, Rng& rng, Batch& batch, RoundResult& res, Clock::time_point t0) {
    const llama_vocab* vocab = llama_model_get_vocab(llama_get_model(in.target));
    std::vector<int32_t> history = in.history;
    llama_token cur = res.next;
    int pos = in.target_n_past + 1;
    while (static_cast<int>(res.more.size()) + 1 < in.plain_steps && !llama_vocab_is_eog(vocab, cur) &&
           since(t0) < in.plain_budget_s) {
        batch.set({cur}, pos++, in.seq, true);
        if (llama_decode(in.target, batch.b) != 0) { res.error = "target llama_decode failed"; return; }
        res.target.kept.push_back(cur);
        push_history(history, cur, in.params);
        cur = sample_context(in.target, -1, history, in.params, rng, in.grammar);
        if (cur < 0) { res.error = "target produced no logits"; return; }
        res.more.push_back(cur);
    }
    const bool capped = static_cast<int>(res.more.size()) + 1 >= in.plain_steps;
    if (in.overlap && !(capped && in.cap_ends_reply)) leave_in_flight(in, batch, res, cur);
}

}  // namespace

RoundResult run_round(const RoundPlan& in, Rng& rng) {
    RoundResult res;
    std::vector<std::vector<float>> q;
    const auto t0 = Clock::now();
    if (in.k > 0 && in.draft) {
        if (!draft_tokens(in, rng, res, q)) return res;
    } else if (in.k > 0) {
        res.drafts.assign(in.proposals.begin(),
                          in.proposals.begin() + std::min<size_t>(in.k, in.proposals.size()));
    }
    res.draft_s = since(t0);

    // verify: the target decodes `last` and every draft in one batch, logits at each position.
    // With `last` already decoded in flight, its logits row is kept and the batch holds the drafts.
    const auto t1 = Clock::now();
    std::vector<llama_token> tokens{in.last};
    tokens.insert(tokens.end(), res.drafts.begin(), res.drafts.end());
    Batch batch(static_cast<int>(tokens.size()));
    std::vector<float> landed;  // the in-flight decode's row, before the drafts' decode replaces it
    std::vector<llama_token> picks;  // with the pick in the graph: each row's, the in-flight one first
    const int first = in.in_flight ? 1 : 0;  // tokens already decoded: `last`, in flight
    if (first && !res.drafts.empty()) {
        if (in.picked) {
            picks.push_back(llama_get_sampled_token_ith(in.target, -1));
        } else {
            const float* row = llama_get_logits_ith(in.target, -1);
            if (!row) { res.error = "target produced no logits"; return res; }
            landed.assign(row, row + n_vocab_of(in.target));
        }
    }
    if (tokens.size() > static_cast<size_t>(first)) {
        batch.set({tokens.begin() + first, tokens.end()}, in.target_n_past + first, in.seq, true);
        if (llama_decode(in.target, batch.b) != 0) { res.error = "target llama_decode failed"; return res; }
    }
    if (res.drafts.empty()) {
        // a plain step: the same pick as verifying no drafts, and it takes a token that a greedy
        // sampler attached to the target picked in the graph (no logits are copied back then)
        res.next = sample_context(in.target, -1, in.history, in.params, rng, in.grammar);
        if (res.next < 0) { res.error = "target produced no logits"; return res; }
    } else if (in.picked) {
        // each row's argmax came back instead of its logits, and point-mass drafts are accepted
        // while they equal it (what verify() does with greedy rows)
        for (size_t i = first; i < tokens.size(); ++i)
            picks.push_back(llama_get_sampled_token_ith(in.target, static_cast<int32_t>(i) - first));
        if (std::count(picks.begin(), picks.end(), LLAMA_TOKEN_NULL)) { res.error = "target picked no token"; return res; }
        while (res.accepted < static_cast<int>(res.drafts.size()) && picks[res.accepted] == res.drafts[res.accepted])
            ++res.accepted;
        res.next = picks[res.accepted];
    } else {
        const int n_vocab = n_vocab_of(in.target);
        std::vector<const float*> rows(tokens.size());
        if (first) rows[0] = landed.data();  // this call's batch rows start after `last`'s
        for (size_t i = first; i < tokens.size(); ++i) {
            rows[i] = llama_get_logits_ith(in.target, static_cast<int32_t>(i) - first);
            if (!rows[i]) { res.error = "target produced no logits"; return res; }
        }
        const bool point_mass = !in.draft;  // n-gram proposals: q(x) = 1
        const Verdict v = verify(rows, n_vocab, res.drafts, point_mass ? std::vector<std::vector<float>>{} : q,
                                 in.history, in.params, in.rule, rng, in.grammar);
        res.accepted = v.accepted;
        res.next = v.next;
        if (in.grammar) in.grammar->accept_allowed(v.next);  // a masked pick
    }
    // the target's KV keeps `last` and the accepted drafts; its owner trims the rejected tail
    res.target.pos = in.target_n_past;
    res.target.kept.push_back(in.last);
    res.target.kept.insert(res.target.kept.end(), res.drafts.begin(), res.drafts.begin() + res.accepted);
    res.target.dropped = static_cast<int>(res.drafts.size()) - res.accepted;
    if (res.drafts.empty() && (in.plain_steps > 1 || in.overlap)) {
        plain_run(in, rng, batch, res, t1);
    } else if (!res.drafts.empty() && in.overlap && !in.draft) {
        // a round of n-gram proposals ends as a plain run does, once its rejected drafts are gone:
        // else the next call decodes `next` while the caller waits (on an H100, 1.5B: 3.5-3.9 ms
        // for the step after a round against a steady step's 2.06-2.12)
        const int end = in.target_n_past + static_cast<int>(res.target.kept.size());
        if (res.target.dropped > 0 && !llama_memory_seq_rm(llama_get_memory(in.target), in.seq, end, -1)) {
            res.error = "llama.cpp could not trim the KV cache";
            return res;
        }
        res.target.dropped = 0;
        leave_in_flight(in, batch, res, res.next);
    }
    res.verify_s = since(t1);
    return res;
}

llama_token sample_context(llama_context* ctx, int idx, const std::vector<int32_t>& history,
                           const SamplerParams& p, Rng& rng, Grammar* grammar) {
    if (!grammar) {
        // a greedy sampler attached to the context (Context.greedy_on_device) picked in the graph
        const llama_token picked = llama_get_sampled_token_ith(ctx, idx);
        if (picked != LLAMA_TOKEN_NULL) return picked;
    }
    const float* logits = llama_get_logits_ith(ctx, idx);
    if (!logits) return -1;
    const int n_vocab = n_vocab_of(ctx);
    llama_token pick;
    if (p.greedy()) {
        pick = grammar ? masked_greedy(logits, n_vocab, history, p, *grammar) : greedy_pick(logits, n_vocab, history, p);
    } else {
        std::vector<float> dist;
        if (grammar) masked_distribution(logits, n_vocab, history, p, *grammar, dist);
        else distribution(logits, n_vocab, history, p, dist);
        pick = sample_dense(dist, rng.uniform());
    }
    if (grammar) grammar->accept_allowed(pick);  // a masked pick
    return pick;
}

}  // namespace edgerun
