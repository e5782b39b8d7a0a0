// ggml's own quantizers: the error one tensor would take in a given type, and llama.cpp's
// whole-model quantizer with per-tensor types and an importance matrix.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ggml.h"

namespace edgerun {

// Sum over rows r and columns c of importance[c] * (w[r,c] - dequant(quant(w))[r,c])^2, where the
// quantizer also sees the importance (as llama.cpp's does). importance may be null (all ones).
// Rows are split over n_threads. Throws std::invalid_argument on a row length the type cannot hold.
double quant_error(ggml_type type, const float* w, int64_t n_rows, int64_t n_cols, const float* importance,
                   int n_threads);

struct QuantizeJob {
    std::string src, dst;
    int ftype = 0;  // llama_ftype
    int n_threads = 0;
    bool allow_requantize = false;
    std::vector<std::pair<std::string, int>> overrides;               // (regex pattern, ggml_type)
    std::vector<std::pair<std::string, std::vector<float>>> imatrix;  // (tensor name, values)
};

// llama.cpp's per-tensor log lines ("[  12/ 290] name ...") become "done total\n" lines on fd (when
// >= 0), for the process that shows the progress; its error lines are kept in `errors`.
struct QuantizeProgress {
    int fd = -1;
    std::string errors;
    int last_level = 0;
};

// Runs llama_model_quantize with llama.cpp's log routed into `progress` for the duration. The log
// callback is process-wide, so call this from a process of its own. Returns llama.cpp's status.
uint32_t run_quantize(const QuantizeJob& job, QuantizeProgress& progress);

}  // namespace edgerun
