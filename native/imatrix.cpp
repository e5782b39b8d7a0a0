#include "imatrix.hpp"

#include <cmath>
#include <cstring>

#include "ggml-backend.h"

namespace edgerun {

namespace {

// Graph names may carry a backend prefix and a copy suffix ("CUDA0#blk.0.attn_k.weight#0").
std::string weight_name(const char* name) {
    const char* p = std::strchr(name, '#');
    if (!p) return name;
    ++p;
    const char* q = std::strchr(p, '#');
    return q ? std::string(p, q - p) : std::string(p);
}

// Rows of floats, or of a type ggml can convert to float, stored contiguously.
bool float_rows(const ggml_tensor* t) {
    const bool convertible = t->type == GGML_TYPE_F32 || ggml_get_type_traits(t->type)->to_float;
    return convertible && t->nb[0] == ggml_type_size(t->type) && ggml_blck_size(t->type) == 1;
}

bool ends_with(const std::string& s, const char* suffix) {
    const size_t n = std::strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// Model weights by name: the per-layer matrices and the output projection (which is
// token_embd.weight itself when the embeddings are tied).
bool is_weight_name(const std::string& name) {
    if (name.rfind("blk.", 0) == 0) return ends_with(name, ".weight");
    return name == "output.weight" || name == "token_embd.weight";
}

}  // namespace

bool ImatrixCollector::eval_callback(ggml_tensor* t, bool ask, void* user_data) {
    auto* self = static_cast<ImatrixCollector*>(user_data);
    if (ask) return self->wants(t);
    // returning false cancels the graph; do that only when the statistics would be wrong
    return self->collect(t);
}

bool ImatrixCollector::wants(const ggml_tensor* t) const {
    if (!capture_name_.empty() && capture_name_ == t->name) return true;
    if (t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_MUL_MAT_ID) return false;
    return t->src[0] && t->src[1] && is_weight_name(weight_name(t->src[0]->name));
}

bool ImatrixCollector::fail(const std::string& message) {
    if (error_.empty()) error_ = message;
    return false;
}

// A host pointer to the tensor's bytes, copied off the device when it lives there.
const char* ImatrixCollector::host_data(const ggml_tensor* t, std::vector<char>& buf) {
    if (t->buffer && ggml_backend_buffer_is_host(t->buffer)) return static_cast<const char*>(t->data);
    buf.resize(ggml_nbytes(t));
    ggml_backend_tensor_get(t, buf.data(), 0, buf.size());
    return buf.data();
}

// Row (i1, i2, i3) of t as floats; rows are contiguous (checked by the callers), dims may be strided.
const float* ImatrixCollector::row_f32(const ggml_tensor* t, const char* base, int64_t i1, int64_t i2, int64_t i3) {
    const char* row = base + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
    if (t->type == GGML_TYPE_F32) return reinterpret_cast<const float*>(row);
    row_buf_.resize(t->ne[0]);
    ggml_get_type_traits(t->type)->to_float(row, row_buf_.data(), t->ne[0]);
    return row_buf_.data();
}

bool ImatrixCollector::collect(const ggml_tensor* t) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.empty()) return false;
    if (!capture_name_.empty() && capture_name_ == t->name) {
        capture(t);
        return true;
    }
    const ggml_tensor* src0 = t->src[0];
    const ggml_tensor* src1 = t->src[1];
    const std::string name = weight_name(src0->name);
    if (!float_rows(src1))
        return fail("activations of " + name + " are not contiguous float rows");
    const int64_t n_mat = src0->ne[2] * src0->ne[3];
    ImatrixEntry& e = entries_[name];
    if (e.sums.empty()) {
        e.n_cols = src1->ne[0];
        e.sums.assign(static_cast<size_t>(n_mat * e.n_cols), 0.0);
        e.counts.assign(static_cast<size_t>(n_mat), 0);
    } else if (e.n_cols != src1->ne[0] || e.counts.size() != static_cast<size_t>(n_mat)) {
        return fail("inconsistent activation shape for " + name);
    }
    return t->op == GGML_OP_MUL_MAT_ID ? collect_experts(t, e) : collect_dense(t, e);
}

// MUL_MAT: src1 is [cols, rows, ne2, ne3]; a 3-D/4-D src0 broadcasts over ne2/ne3 as ggml_mul_mat does.
bool ImatrixCollector::collect_dense(const ggml_tensor* t, ImatrixEntry& e) {
    const ggml_tensor* src0 = t->src[0];
    const ggml_tensor* src1 = t->src[1];
    const char* base = host_data(src1, src_buf_);
    const int64_t n_cols = e.n_cols;
    for (int64_t i3 = 0; i3 < src1->ne[3]; ++i3) {
        for (int64_t i2 = 0; i2 < src1->ne[2]; ++i2) {
            const int64_t mat = (i3 % src0->ne[3]) * src0->ne[2] + (i2 % src0->ne[2]);
            double* acc = e.sums.data() + mat * n_cols;
            for (int64_t i1 = 0; i1 < src1->ne[1]; ++i1) {
                const float* x = row_f32(src1, base, i1, i2, i3);
                for (int64_t j = 0; j < n_cols; ++j) acc[j] += static_cast<double>(x[j]) * x[j];
            }
            e.counts[mat] += src1->ne[1];
        }
    }
    for (double v : e.sums)
        if (!std::isfinite(v)) return fail("non-finite activations reach " + weight_name(src0->name));
    return true;
}

// MUL_MAT_ID: src0 is [cols, rows, n_expert], src1 [cols, n_used or 1, n_tokens], ids (int32)
// [n_used, n_tokens] names the expert each (slot, token) pair goes through.
bool ImatrixCollector::collect_experts(const ggml_tensor* t, ImatrixEntry& e) {
    const ggml_tensor* src0 = t->src[0];
    const ggml_tensor* src1 = t->src[1];
    const ggml_tensor* ids = t->src[2];
    if (!ids || ids->type != GGML_TYPE_I32 || ids->ne[1] != src1->ne[2])
        return fail("unexpected expert routing tensor for " + weight_name(src0->name));
    const char* base = host_data(src1, src_buf_);
    const char* id_base = host_data(ids, ids_buf_);
    const int64_t n_expert = src0->ne[2];
    for (int64_t tok = 0; tok < src1->ne[2]; ++tok) {
        for (int64_t slot = 0; slot < ids->ne[0]; ++slot) {
            const int32_t ex = *reinterpret_cast<const int32_t*>(id_base + tok * ids->nb[1] + slot * ids->nb[0]);
            if (ex < 0 || ex >= n_expert) return fail("expert id out of range for " + weight_name(src0->name));
            const float* x = row_f32(src1, base, slot % src1->ne[1], tok, 0);
            double* acc = e.sums.data() + ex * e.n_cols;
            for (int64_t j = 0; j < e.n_cols; ++j) acc[j] += static_cast<double>(x[j]) * x[j];
            e.counts[ex] += 1;
        }
    }
    return true;
}

void ImatrixCollector::capture(const ggml_tensor* t) {
    if (!float_rows(t)) {
        fail(std::string("captured node ") + t->name + " is not a float tensor");
        return;
    }
    const char* base = host_data(t, src_buf_);
    captured_cols_ = t->ne[0];
    for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
        for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
            for (int64_t i1 = 0; i1 < t->ne[1]; ++i1) {
                const float* x = row_f32(t, base, i1, i2, i3);
                captured_.insert(captured_.end(), x, x + t->ne[0]);
            }
}

std::map<std::string, ImatrixEntry> ImatrixCollector::entries() const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_;
}

std::vector<float> ImatrixCollector::captured(int64_t& n_cols) const {
    std::lock_guard<std::mutex> lock(mu_);
    n_cols = captured_cols_;
    return captured_;
}

std::string ImatrixCollector::error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
}

void ImatrixCollector::reset() {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.clear();
    error_.clear();
    captured_.clear();
    captured_cols_ = 0;
}

}  // namespace edgerun
