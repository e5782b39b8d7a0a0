// The importance matrix: per weight, the sum over all input rows of x^2 per input column, gathered
// by a ggml scheduler eval callback while llama.cpp runs calibration text.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ggml.h"

namespace edgerun {

struct ImatrixEntry {
    int64_t n_cols = 0;             // the weight's input dimension (ne[0])
    std::vector<double> sums;       // n_mat * n_cols: sum of x^2 per matrix (expert) and column
    std::vector<int64_t> counts;    // n_mat: rows seen per matrix (expert)
};

// One collector per calibration run. The Python side owns it and hands its address to llama.cpp as
// the eval callback's user data; llama.cpp calls `eval_callback` from the thread running decode.
class ImatrixCollector {
public:
    static bool eval_callback(ggml_tensor* t, bool ask, void* user_data);

    // Also keep the raw output rows of the graph node with this name (e.g. "attn_norm-0"), for tests
    // that check the accumulation against an independent read of the same activations.
    void set_capture(const std::string& node_name) { capture_name_ = node_name; }

    std::map<std::string, ImatrixEntry> entries() const;
    std::vector<float> captured(int64_t& n_cols) const;
    std::string error() const;
    void reset();

private:
    bool wants(const ggml_tensor* t) const;
    bool collect(const ggml_tensor* t);
    bool collect_dense(const ggml_tensor* t, ImatrixEntry& e);
    bool collect_experts(const ggml_tensor* t, ImatrixEntry& e);
    void capture(const ggml_tensor* t);
    const char* host_data(const ggml_tensor* t, std::vector<char>& buf);
    const float* row_f32(const ggml_tensor* t, const char* base, int64_t i1, int64_t i2, int64_t i3);
    bool fail(const std::string& message);

    mutable std::mutex mu_;
    std::map<std::string, ImatrixEntry> entries_;
    std::string error_;
    std::string capture_name_;
    std::vector<float> captured_;
    int64_t captured_cols_ = 0;
    std::vector<char> src_buf_, ids_buf_;   // device copies of src1 and the expert ids
    std::vector<float> row_buf_;            // one row converted to float
};

}  // namespace edgerun
