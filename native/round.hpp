// One speculative round on llama.cpp contexts, with no Python between draft steps. Python builds
// one RoundPlan (edgerun/decode/speculative.py) and commits the RoundResult's KvWrites to its
// contexts (edgerun/runtime/engine.py, Context.commit): the round decodes, the context records.
#pragma once

#include <llama.h>

#include <string>
#include <vector>

#include "grammar.hpp"
#include "sampling.hpp"

namespace edgerun {

struct RoundPlan {
    llama_context* target = nullptr;
    llama_context* draft = nullptr;      // null: use `proposals` (n-gram drafter) or plain step
    int seq = 0;                         // the sequence (llama_seq_id) in both contexts
    std::vector<llama_token> draft_feed; // tokens the draft's KV lacks, ending with `last`
    int draft_n_past = 0;                // where draft_feed starts
    llama_token last = 0;                // the newest token, not yet in the target's KV
    int target_n_past = 0;               // where `last` goes
    int k = 0;                           // most tokens to draft (0: a plain decoding step)
    float p_min = 0.0f;                  // stop drafting when the draft's top probability is below
    std::vector<llama_token> proposals;  // drafts given from outside (used when draft is null)
    std::vector<int32_t> history;        // committed tokens the repetition penalty may see
    SamplerParams params;
    AcceptRule rule = AcceptRule::Rejection;
    int plain_steps = 1;                 // k = 0: decode up to this many tokens in one call
    double plain_budget_s = 0.05;        // ... but return within about this long (cancellation)
    // Every draft decode one token with its logits (the feed token by token, the last draft
    // evaluated too), so the draft's graph keeps one shape. On CUDA a graph whose shape changed
    // runs uncaptured and is captured again on the second same-shape call, which a round of a
    // 2-token feed then single steps pays every time.
    bool stable_shapes = false;
    // `last` is already decoded at target_n_past (a previous call left it in flight): a plain
    // step only reads that decode's pick; a round of n-gram proposals keeps its logits row and
    // decodes the proposals after it (a model draft's round lands it first: Context.land).
    bool in_flight = false;
    // A plain run that stops at its step cap or time budget decodes its newest token before
    // returning, without waiting for it: on a GPU that step runs while Python handles the
    // tokens, and the next call (in_flight) starts from its result. A round of n-gram proposals
    // does the same with `next`, once it has trimmed its rejected drafts (its KvWrite then
    // drops nothing). The caller asks only where the reply goes on after the round.
    bool overlap = false;
    bool cap_ends_reply = false;  // reaching plain_steps ends the reply: nothing to overlap then
    // A greedy sampler attached to the target (Context.greedy_on_device) picks in the graph: a
    // round of n-gram proposals verifies by each row's pick, the in-flight decode's included.
    bool picked = false;
    // The reply's grammar, in its state after `last` (null: unconstrained). Every pick is made
    // under it, the draft's too (on a copy), and the round advances it along every token it
    // keeps, so after the round it stands after `next` (and a plain run's `more`).
    Grammar* grammar = nullptr;
};

// What a round left in one context's KV for the plan's sequence, for its owner to record.
struct KvWrite {
    int pos = 0;                      // where `kept` starts (the context's n_past before the round)
    std::vector<llama_token> kept;    // the tokens the cache now holds from pos on, in order
    int dropped = 0;                  // positions after kept the round decoded and does not keep
                                      // (rejected drafts): the owner trims them
    bool in_flight = false;           // one more decode after kept, its pick not yet read
};

struct RoundResult {
    std::vector<llama_token> drafts;  // what was proposed
    int accepted = 0;
    llama_token next = -1;
    std::vector<llama_token> more;  // k = 0 with plain_steps > 1: the tokens after `next`, in order
    KvWrite target;                 // `last`, the accepted drafts, and a plain run's tokens but its newest
    KvWrite draft;                  // the feed and the drafts the draft evaluated (model drafts only)
    double draft_s = 0, verify_s = 0;
    std::string error;        // non-empty: llama.cpp failed; what the KVs hold past their
                              // recorded tokens is for the owner to drop
};

RoundResult run_round(const RoundPlan& plan, Rng& rng);

// Sample from output `idx` of the last decode of ctx (the first token after a prompt), or take
// the token a greedy sampler attached to ctx picked inside the graph. With a grammar: the pick
// is made under it and the grammar advances past it (no sampler may be attached then).
llama_token sample_context(llama_context* ctx, int idx, const std::vector<int32_t>& history,
                           const SamplerParams& p, Rng& rng, Grammar* grammar = nullptr);

}  // namespace edgerun
