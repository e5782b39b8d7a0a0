// Sampling math shared by plain and speculative decoding. Pure functions on logit rows; the
// NumPy reference in edgerun/decode/reference.py mirrors every step (tests compare them).
#pragma once

#include <cstdint>
#include <vector>

namespace edgerun {

class Grammar;  // grammar.hpp

struct SamplerParams {
    float temperature = 0.7f;  // <= 0: greedy
    int top_k = 40;            // <= 0: off
    float top_p = 0.95f;       // >= 1: off
    float min_p = 0.05f;       // <= 0: off
    float repeat_penalty = 1.0f;
    int repeat_last_n = 64;
    bool greedy() const { return temperature <= 0.0f; }
};

// xoshiro256** seeded through splitmix64: small, fast, and easy to mirror in Python.
class Rng {
  public:
    explicit Rng(uint64_t seed);
    uint64_t next();
    double uniform();  // [0, 1) with 53 random bits
    const uint64_t* state() const { return s_; }

  private:
    uint64_t s_[4];
};

// The repetition window, as llama.cpp means repeat_last_n: the last N tokens, -1 the whole
// context, 0 none (and none with a penalty of 1). Python's RepeatWindow (decode/generate.py)
// hands the round the committed part; tokens the round adds go through push_history.
bool penalty_on(const SamplerParams& p);

// Append a token the round produced to its history, keeping it within the window.
void push_history(std::vector<int32_t>& history, int32_t token, const SamplerParams& p);

// llama.cpp's repetition penalty: logits of tokens seen in the window of the history are
// divided by the penalty when positive, multiplied when negative.
void apply_penalty(float* logits, int n_vocab, const std::vector<int32_t>& history, const SamplerParams& p);

// The first index of the largest value.
int32_t argmax(const float* x, int n);

// Whether token x's probability under the temperature-1 softmax of logits is at least p_min.
bool top_share_reaches(const float* logits, int n, int32_t x, double p_min);

// argmax after the repetition penalty; reads the logits in place when no penalty applies.
int32_t greedy_pick(const float* logits, int n_vocab, const std::vector<int32_t>& history, const SamplerParams& p);

// Dense next-token distribution after llama.cpp's chain order: penalty, top-k, top-p and min-p
// (on the temperature-1 softmax), then temperature over the kept candidates. out has n_vocab
// entries summing to 1; tokens filtered out are exactly 0. Requires temperature > 0.
void distribution(const float* logits, int n_vocab, const std::vector<int32_t>& history,
                  const SamplerParams& p, std::vector<float>& out);

// Inverse-CDF draw in token-id order, accumulated in double.
int32_t sample_dense(const std::vector<float>& probs, double u);

enum class AcceptRule { Rejection, Match };

struct Verdict {
    int accepted = 0;     // how many leading draft tokens were kept
    int32_t next = -1;    // the target's token after them (correction or bonus)
};

// Decide a drafted run. rows[i] holds the target's logits after the i-th verified position
// (rows.size() == drafts.size() + 1). q[i] is the dense draft distribution drafts[i] was drawn
// from, or empty for a point-mass drafter (n-gram) whose q(x) = 1.
// With a grammar (g non-null, its state before drafts[0]) p is the constrained distribution
// (grammar.hpp) at every position, so a draft the grammar refuses has p(x) = 0 and is rejected,
// and the residual max(0, p - q) holds only allowed tokens. g advances along the accepted drafts;
// the caller accepts `next`.
Verdict verify(const std::vector<const float*>& rows, int n_vocab, const std::vector<int32_t>& drafts,
               const std::vector<std::vector<float>>& q, std::vector<int32_t> history,
               const SamplerParams& p, AcceptRule rule, Rng& rng, Grammar* g = nullptr);

}  // namespace edgerun
