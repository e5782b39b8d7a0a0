// A grammar's state along one token sequence: llama.cpp's GBNF grammar sampler, driven token by
// token. The round asks which candidates it allows, advances it along drafts (a copy per draft)
// and along the committed tokens (the reply's own state), and never accepts a token it refuses.
#pragma once

#include <llama.h>

#include <string>
#include <vector>

#include "sampling.hpp"

namespace edgerun {

class Grammar {
  public:
    // Throws std::invalid_argument when llama.cpp refuses the grammar (its log says where).
    // Lazy (trigger_patterns non-empty): every token is allowed until the output matches a
    // pattern; the grammar then takes the text from the pattern's first group on.
    Grammar(const llama_vocab* vocab, const std::string& gbnf, const std::string& root,
            const std::vector<std::string>& trigger_patterns = {});
    Grammar(const Grammar& other);  // an independent copy of the state (llama_sampler_clone)
    Grammar& operator=(const Grammar&) = delete;
    ~Grammar();

    bool allows(llama_token token);
    // Keep only the allowed ids of `ids`, in order (one pass of llama.cpp's grammar apply).
    void filter(std::vector<int32_t>& ids);
    // Advance past `token`; throws std::invalid_argument if the grammar refuses it (llama.cpp
    // would abort the process on a refused end-of-generation token).
    void accept(llama_token token);
    // Advance past a token a masked pick chose (so known to be allowed): no second check.
    void accept_allowed(llama_token token) { llama_sampler_accept(s_, token); }
    void swap(Grammar& other) noexcept { std::swap(s_, other.s_); std::swap(vocab_, other.vocab_); }
    const llama_vocab* vocab() const { return vocab_; }

  private:
    llama_sampler* s_ = nullptr;
    const llama_vocab* vocab_ = nullptr;
    std::vector<llama_token_data> buf_;
};

// The target's (or the draft's) greedy pick under the grammar: the first index of the largest
// penalized logit among the tokens it allows. The unconstrained argmax is checked first, then the
// best 64 candidates, and only then the whole vocabulary.
int32_t masked_greedy(const float* logits, int n_vocab, const std::vector<int32_t>& history,
                      const SamplerParams& p, Grammar& g);

// The constrained distribution: the sampler chain's distribution (penalty, top-k, top-p, min-p,
// temperature) restricted to the tokens the grammar allows and renormalized; when the chain keeps
// no allowed token, the chain runs again on the allowed tokens among the best M candidates by
// logit (M the first of 64, 4096 and the whole vocabulary that holds one). Only the chain's
// survivors, or the best few candidates, are checked, which keeps the mask cheap; the result is
// a function of the logits and the grammar state alone, which is what exact speculation needs.
void masked_distribution(const float* logits, int n_vocab, const std::vector<int32_t>& history,
                         const SamplerParams& p, Grammar& g, std::vector<float>& out);

}  // namespace edgerun
