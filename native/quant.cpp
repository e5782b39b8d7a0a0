#include "quant.hpp"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <thread>

#include <unistd.h>

#include "llama.h"

namespace edgerun {

namespace {

// Quantize and dequantize rows [r0, r1) and return their weighted squared error.
double rows_error(ggml_type type, const float* w, int64_t r0, int64_t r1, int64_t n_cols, const float* importance) {
    const size_t row_size = ggml_row_size(type, n_cols);
    std::vector<uint8_t> q(row_size);
    std::vector<float> back(n_cols);
    const auto* traits = ggml_get_type_traits(type);
    double total = 0.0;
    for (int64_t r = r0; r < r1; ++r) {
        const float* x = w + r * n_cols;
        ggml_quantize_chunk(type, x, q.data(), 0, 1, n_cols, importance);
        traits->to_float(q.data(), back.data(), n_cols);
        for (int64_t c = 0; c < n_cols; ++c) {
            const double d = static_cast<double>(x[c]) - back[c];
            total += (importance ? importance[c] : 1.0f) * d * d;
        }
    }
    return total;
}

void log_to_progress(ggml_log_level level, const char* text, void* user_data) {
    auto* p = static_cast<QuantizeProgress*>(user_data);
    if (level != GGML_LOG_LEVEL_CONT) p->last_level = level;
    int done = 0, total = 0;
    if (p->fd >= 0 && level == GGML_LOG_LEVEL_INFO && std::sscanf(text, "[%d/%d]", &done, &total) == 2) {
        char line[32];
        const int n = std::snprintf(line, sizeof line, "%d %d\n", done - 1, total);  // logged as it starts
        if (write(p->fd, line, n) < 0) p->fd = -1;  // the reader is gone: stop reporting, keep working
    }
    if (p->last_level == GGML_LOG_LEVEL_ERROR) p->errors += text;
}

}  // namespace

double quant_error(ggml_type type, const float* w, int64_t n_rows, int64_t n_cols, const float* importance,
                   int n_threads) {
    const auto* traits = ggml_get_type_traits(type);
    // ggml_quantize_chunk aborts the process on a type it has no quantizer for, or an
    // imatrix-only type without one: refuse those here
    const bool has_quantizer = (traits->is_quantized && type != GGML_TYPE_Q8_1 && type != GGML_TYPE_Q8_K) ||
                               type == GGML_TYPE_F16 || type == GGML_TYPE_BF16 || type == GGML_TYPE_F32;
    if (!has_quantizer || (ggml_quantize_requires_imatrix(type) && !importance))
        throw std::invalid_argument(std::string("ggml cannot quantize to ") + ggml_type_name(type) +
                                    (has_quantizer ? " without an importance matrix" : ""));
    // ggml_quantize_chunk checks start % n_per_row: rows of no values divide by zero (SIGFPE)
    if (n_cols <= 0) throw std::invalid_argument("rows of 0 values cannot be quantized");
    if (n_cols % ggml_blck_size(type) != 0)
        throw std::invalid_argument(std::string("rows of ") + std::to_string(n_cols) + " values cannot be stored as " +
                                    ggml_type_name(type));
    if (type == GGML_TYPE_F32) return 0.0;  // stored as is
    ggml_quantize_init(type);  // the shared tables must exist before threads use them
    n_threads = std::max(1, std::min<int>(n_threads, static_cast<int>(n_rows)));
    std::vector<double> part(n_threads, 0.0);
    std::vector<std::thread> workers;
    for (int i = 0; i < n_threads; ++i) {
        const int64_t r0 = n_rows * i / n_threads, r1 = n_rows * (i + 1) / n_threads;
        workers.emplace_back([&, i, r0, r1] { part[i] = rows_error(type, w, r0, r1, n_cols, importance); });
    }
    double total = 0.0;
    for (int i = 0; i < n_threads; ++i) {
        workers[i].join();
        total += part[i];
    }
    return total;
}

uint32_t run_quantize(const QuantizeJob& job, QuantizeProgress& progress) {
    std::vector<llama_model_tensor_override> overrides;
    for (const auto& [pattern, type] : job.overrides)
        overrides.push_back({pattern.c_str(), static_cast<ggml_type>(type)});
    overrides.push_back({nullptr, GGML_TYPE_COUNT});  // the list ends at a null pattern
    std::vector<llama_model_imatrix_data> imatrix;
    for (const auto& [name, values] : job.imatrix) imatrix.push_back({name.c_str(), values.data(), values.size()});
    imatrix.push_back({nullptr, nullptr, 0});

    llama_model_quantize_params params = llama_model_quantize_default_params();
    params.nthread = job.n_threads;
    params.ftype = static_cast<llama_ftype>(job.ftype);
    params.allow_requantize = job.allow_requantize;
    params.tt_overrides = overrides.size() > 1 ? overrides.data() : nullptr;
    params.imatrix = imatrix.size() > 1 ? imatrix.data() : nullptr;

    llama_log_set(log_to_progress, &progress);
    const uint32_t rc = llama_model_quantize(job.src.c_str(), job.dst.c_str(), &params);
    llama_log_set(nullptr, nullptr);  // back to llama.cpp's default (stderr) before progress goes away
    return rc;
}

}  // namespace edgerun
