// edgerun._native_ext (imported as edgerun._native, after llama_cpp): the Python face of the
// speculative round, the sampling math, the importance-matrix collector and ggml's quantizers.
// Python owns every llama.cpp handle and passes raw addresses in; nothing here frees them.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>

#include "gguf.h"
#include "grammar.hpp"
#include "imatrix.hpp"
#include "quant.hpp"
#include "round.hpp"
#include "sampling.hpp"

namespace py = pybind11;
using namespace edgerun;

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

// llama.cpp's log reaches Python (edgerun/runtime/llama_log.py) through this filter. ggml logs a
// debug line on every CUDA graph replay, i.e. every decode step on a GPU; through a Python
// callback each is a GIL round trip inside llama_decode, and in the chat app the step waits
// for the UI thread to hand the GIL over. Debug lines go on only when asked for.
struct LogRoute {
    std::atomic<ggml_log_callback> next{nullptr};
    std::atomic<bool> debug{false};
    std::atomic<int> last{GGML_LOG_LEVEL_INFO};  // what a continuation (GGML_LOG_LEVEL_CONT) continues
};
LogRoute log_route;

void filtered_log(ggml_log_level level, const char* text, void* user) {
    int effective = level;
    if (level == GGML_LOG_LEVEL_CONT) effective = log_route.last.load();
    else log_route.last.store(level);
    const ggml_log_callback next = log_route.next.load();
    if (next && (effective != GGML_LOG_LEVEL_DEBUG || log_route.debug.load())) next(level, text, user);
}

llama_context* as_ctx(uintptr_t address) { return reinterpret_cast<llama_context*>(address); }

AcceptRule rule_of(const std::string& name) {
    if (name == "rejection") return AcceptRule::Rejection;
    if (name == "match") return AcceptRule::Match;
    throw std::invalid_argument("rule must be 'rejection' or 'match'");
}

py::array_t<float> py_distribution(FloatArray logits, const std::vector<int32_t>& history, const SamplerParams& p) {
    if (p.greedy()) throw std::invalid_argument("distribution needs temperature > 0");
    std::vector<float> out;
    distribution(logits.data(), static_cast<int>(logits.size()), history, p, out);
    return py::array_t<float>(out.size(), out.data());
}

// verify() on arrays: rows (m+1, V) target logits, q (m, V) draft distributions or None.
py::tuple py_verify(FloatArray rows, const std::vector<int32_t>& drafts, py::object q_obj,
                    const std::vector<int32_t>& history, const SamplerParams& p, const std::string& rule, Rng& rng,
                    Grammar* grammar) {
    if (rows.ndim() != 2 || rows.shape(0) != static_cast<py::ssize_t>(drafts.size() + 1))
        throw std::invalid_argument("rows must be (len(drafts) + 1, n_vocab)");
    const int n_vocab = static_cast<int>(rows.shape(1));
    std::vector<const float*> ptrs;
    for (py::ssize_t i = 0; i < rows.shape(0); ++i) ptrs.push_back(rows.data(i, 0));
    std::vector<std::vector<float>> q;
    if (!q_obj.is_none()) {
        auto qa = q_obj.cast<FloatArray>();
        if (qa.ndim() != 2 || qa.shape(1) != rows.shape(1))
            throw std::invalid_argument("q must be (len(drafts), n_vocab)");
        for (py::ssize_t i = 0; i < qa.shape(0); ++i) q.emplace_back(qa.data(i, 0), qa.data(i, 0) + n_vocab);
    }
    if (grammar && n_vocab != llama_vocab_n_tokens(grammar->vocab()))
        throw std::invalid_argument("rows must have one logit per token of the grammar's vocabulary");
    const Verdict v = verify(ptrs, n_vocab, drafts, q, history, p, rule_of(rule), rng, grammar);
    return py::make_tuple(v.accepted, v.next);
}

const char* rule_name(AcceptRule r) { return r == AcceptRule::Match ? "match" : "rejection"; }

std::string tokens_repr(const std::vector<llama_token>& v) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
    return out + "]";
}

RoundResult py_round(const RoundPlan& plan, Rng& rng) {
    if (!plan.target) throw std::invalid_argument("the plan has no target context");
    if (plan.in_flight && plan.k > 0 && plan.draft)
        throw std::invalid_argument("a model draft's round cannot start from a decode in flight");
    if (plan.picked && (plan.draft || plan.grammar || !plan.params.greedy()))
        throw std::invalid_argument("only a greedy n-gram round without a grammar verifies by the graph's pick");
    if (plan.draft && plan.k > 0 && plan.draft_feed.empty()) throw std::invalid_argument("draft_feed must end with last");
    RoundPlan in = plan;
    in.plain_steps = std::max(1, plan.plain_steps);
    RoundResult r;
    {
        py::gil_scoped_release release;  // the TUI keeps drawing while llama.cpp works
        r = run_round(in, rng);
    }
    if (!r.error.empty()) throw std::runtime_error(r.error);
    return r;
}

// The context pointers cross as addresses (Context.address); Python owns the contexts.
template <llama_context* RoundPlan::*field>
void bind_context(py::class_<RoundPlan>& c, const char* name) {
    c.def_property(name, [](const RoundPlan& p) { return reinterpret_cast<uintptr_t>(p.*field); },
                   [](RoundPlan& p, uintptr_t address) { p.*field = as_ctx(address); });
}

void bind_round(py::module_& m) {
    py::class_<RoundPlan> plan(m, "RoundPlan", "Everything one native round needs (native/round.hpp).");
    plan.def(py::init<>());
    bind_context<&RoundPlan::target>(plan, "target");
    bind_context<&RoundPlan::draft>(plan, "draft");
    plan.def_readwrite("seq", &RoundPlan::seq)
        .def_readwrite("draft_feed", &RoundPlan::draft_feed)
        .def_readwrite("draft_n_past", &RoundPlan::draft_n_past)
        .def_readwrite("last", &RoundPlan::last)
        .def_readwrite("target_n_past", &RoundPlan::target_n_past)
        .def_readwrite("k", &RoundPlan::k)
        .def_readwrite("p_min", &RoundPlan::p_min)
        .def_readwrite("proposals", &RoundPlan::proposals)
        .def_readwrite("history", &RoundPlan::history)
        .def_readwrite("params", &RoundPlan::params)
        .def_property("rule", [](const RoundPlan& p) { return std::string(rule_name(p.rule)); },
                      [](RoundPlan& p, const std::string& name) { p.rule = rule_of(name); })
        .def_readwrite("plain_steps", &RoundPlan::plain_steps)
        .def_readwrite("plain_budget_s", &RoundPlan::plain_budget_s)
        .def_readwrite("stable_shapes", &RoundPlan::stable_shapes)
        .def_readwrite("in_flight", &RoundPlan::in_flight)
        .def_readwrite("overlap", &RoundPlan::overlap)
        .def_readwrite("cap_ends_reply", &RoundPlan::cap_ends_reply)
        .def_readwrite("picked", &RoundPlan::picked)
        // the plan keeps its grammar object alive: the round runs on the raw pointer
        .def_property("grammar", py::cpp_function([](const RoundPlan& p) { return p.grammar; },
                                                  py::return_value_policy::reference),
                      py::cpp_function([](RoundPlan& p, Grammar* g) { p.grammar = g; }, py::keep_alive<1, 2>()))
        .def("__repr__", [](const RoundPlan& p) {
            return "RoundPlan(seq=" + std::to_string(p.seq) + ", last=" + std::to_string(p.last) +
                   ", target_n_past=" + std::to_string(p.target_n_past) + ", k=" + std::to_string(p.k) +
                   (p.draft ? ", draft_feed=" + tokens_repr(p.draft_feed) : "") +
                   (p.proposals.empty() ? "" : ", proposals=" + tokens_repr(p.proposals)) +
                   ", plain_steps=" + std::to_string(p.plain_steps) + ", rule='" + rule_name(p.rule) + "'" +
                   (p.in_flight ? ", in_flight" : "") + (p.overlap ? ", overlap" : "") +
                   (p.picked ? ", picked" : "") + ")";
        });

    py::class_<KvWrite>(m, "KvWrite", "What a round left in one context's KV (native/round.hpp).")
        .def_readonly("pos", &KvWrite::pos)
        .def_readonly("kept", &KvWrite::kept)
        .def_readonly("dropped", &KvWrite::dropped)
        .def_readonly("in_flight", &KvWrite::in_flight)
        .def("__repr__", [](const KvWrite& w) {
            return "KvWrite(pos=" + std::to_string(w.pos) + ", kept=" + tokens_repr(w.kept) + ", dropped=" +
                   std::to_string(w.dropped) + (w.in_flight ? ", in_flight" : "") + ")";
        });

    py::class_<RoundResult>(m, "RoundResult", "What one native round decided and decoded (native/round.hpp).")
        .def_readonly("drafts", &RoundResult::drafts)
        .def_readonly("accepted", &RoundResult::accepted)
        .def_readonly("next", &RoundResult::next)
        .def_readonly("more", &RoundResult::more)
        .def_readonly("target", &RoundResult::target)
        .def_readonly("draft", &RoundResult::draft)
        .def_readonly("draft_s", &RoundResult::draft_s)
        .def_readonly("verify_s", &RoundResult::verify_s)
        .def("__repr__", [](const RoundResult& r) {
            return "RoundResult(drafts=" + tokens_repr(r.drafts) + ", accepted=" + std::to_string(r.accepted) +
                   ", next=" + std::to_string(r.next) + ", more=" + tokens_repr(r.more) + ")";
        });
    m.def("round", &py_round, py::arg("plan"), py::arg("rng"),
          "One speculative round (a plain step or stretch when plan.k is 0).");
}

void bind_grammar(py::module_& m) {
    py::class_<Grammar>(m, "Grammar", "A GBNF grammar's state along one token sequence (native/grammar.hpp).")
        .def(py::init([](uintptr_t ctx, const std::string& gbnf, const std::string& root,
                         const std::vector<std::string>& triggers) {
                 return new Grammar(llama_model_get_vocab(llama_get_model(as_ctx(ctx))), gbnf, root, triggers);
             }), py::arg("ctx"), py::arg("gbnf"), py::arg("root") = "root",
             py::arg("trigger_patterns") = std::vector<std::string>{})
        .def("copy", [](const Grammar& g) { return new Grammar(g); })
        .def("allows", &Grammar::allows, py::arg("token"))
        .def("allowed", [](Grammar& g, std::vector<int32_t> ids) { g.filter(ids); return ids; }, py::arg("tokens"),
             "The allowed tokens among `tokens`, in order.")
        .def("accept", &Grammar::accept, py::arg("token"))
        .def("masked_distribution", [](Grammar& g, FloatArray logits, const std::vector<int32_t>& history,
                                       const SamplerParams& p) {
            if (p.greedy()) throw std::invalid_argument("distribution needs temperature > 0");
            if (logits.size() != llama_vocab_n_tokens(g.vocab()))
                throw std::invalid_argument("one logit per token of the grammar's vocabulary");
            std::vector<float> out;
            masked_distribution(logits.data(), static_cast<int>(logits.size()), history, p, g, out);
            return py::array_t<float>(out.size(), out.data());
        }, py::arg("logits"), py::arg("history"), py::arg("params"))
        .def("masked_greedy", [](Grammar& g, FloatArray logits, const std::vector<int32_t>& history,
                                 const SamplerParams& p) {
            if (logits.size() != llama_vocab_n_tokens(g.vocab()))
                throw std::invalid_argument("one logit per token of the grammar's vocabulary");
            return masked_greedy(logits.data(), static_cast<int>(logits.size()), history, p, g);
        }, py::arg("logits"), py::arg("history"), py::arg("params"));
}

// {weight name: (sums float64 (n_mat, n_cols), rows seen int64 (n_mat,))}
py::dict imatrix_results(const ImatrixCollector& c) {
    py::dict out;
    for (const auto& [name, e] : c.entries()) {
        const auto n_mat = static_cast<py::ssize_t>(e.counts.size());
        py::array_t<double> sums({n_mat, static_cast<py::ssize_t>(e.n_cols)});
        std::copy(e.sums.begin(), e.sums.end(), sums.mutable_data());
        py::array_t<int64_t> counts(n_mat);
        std::copy(e.counts.begin(), e.counts.end(), counts.mutable_data());
        out[py::str(name)] = py::make_tuple(sums, counts);
    }
    return out;
}

py::array_t<float> imatrix_captured(const ImatrixCollector& c) {
    int64_t n_cols = 0;
    const std::vector<float> rows = c.captured(n_cols);
    const py::ssize_t n_rows = n_cols ? static_cast<py::ssize_t>(rows.size()) / n_cols : 0;
    py::array_t<float> out({n_rows, static_cast<py::ssize_t>(n_cols)});
    std::copy(rows.begin(), rows.end(), out.mutable_data());
    return out;
}

double py_quant_error(int type, FloatArray w, py::object importance, int n_threads) {
    if (type < 0 || type >= GGML_TYPE_COUNT) throw std::invalid_argument("unknown ggml type");
    if (w.ndim() != 2) throw std::invalid_argument("weights must be a 2-D (rows, cols) array");
    const int64_t n_rows = w.shape(0), n_cols = w.shape(1);
    FloatArray imp;
    if (!importance.is_none()) {
        imp = importance.cast<FloatArray>();
        if (imp.ndim() != 1 || imp.shape(0) != n_cols)
            throw std::invalid_argument("importance must have one value per column");
    }
    const float* imp_ptr = importance.is_none() ? nullptr : imp.data();
    py::gil_scoped_release release;
    return quant_error(static_cast<ggml_type>(type), w.data(), n_rows, n_cols, imp_ptr, n_threads);
}

// progress_fd: where "done total" lines go (-1: nowhere).
py::tuple py_quantize_model(const std::string& src, const std::string& dst, int ftype, int n_threads,
                            bool allow_requantize, const std::vector<std::pair<std::string, int>>& overrides,
                            py::dict imatrix, int progress_fd) {
    QuantizeJob job;
    job.src = src;
    job.dst = dst;
    job.ftype = ftype;
    job.n_threads = n_threads;
    job.allow_requantize = allow_requantize;
    job.overrides = overrides;
    for (auto item : imatrix) {
        auto values = item.second.cast<FloatArray>();
        job.imatrix.emplace_back(item.first.cast<std::string>(),
                                 std::vector<float>(values.data(), values.data() + values.size()));
    }
    QuantizeProgress progress;
    progress.fd = progress_fd;
    uint32_t rc;
    {
        py::gil_scoped_release release;
        rc = run_quantize(job, progress);
    }
    return py::make_tuple(rc, progress.errors);
}

// {tensor name: (ggml type, ne)} from a GGUF's header, read by ggml's own parser (no data, fast:
// gguf-py's reader parses every metadata field, the whole vocabulary included).
py::dict gguf_tensors(const std::string& path) {
    gguf_init_params params{/*no_alloc=*/true, /*ctx=*/nullptr};
    gguf_context* ctx = gguf_init_from_file(path.c_str(), params);
    if (!ctx) throw std::invalid_argument(path + ": not a readable GGUF file");
    py::dict out;
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx); ++i) {
        const int64_t* ne = gguf_get_tensor_ne(ctx, i);
        std::vector<int64_t> dims(ne, ne + GGML_MAX_DIMS);
        while (dims.size() > 1 && dims.back() == 1) dims.pop_back();
        const int type = static_cast<int>(gguf_get_tensor_type(ctx, i));
        out[py::str(gguf_get_tensor_name(ctx, i))] = py::make_tuple(type, dims);
    }
    gguf_free(ctx);
    return out;
}

}  // namespace

PYBIND11_MODULE(_native_ext, m) {
    m.doc() = "edgerun's native hot path: the speculative round, the sampling math, the imatrix and the quantizers";

    py::class_<SamplerParams>(m, "SamplerParams")
        .def(py::init<>())
        .def_readwrite("temperature", &SamplerParams::temperature)
        .def_readwrite("top_k", &SamplerParams::top_k)
        .def_readwrite("top_p", &SamplerParams::top_p)
        .def_readwrite("min_p", &SamplerParams::min_p)
        .def_readwrite("repeat_penalty", &SamplerParams::repeat_penalty)
        .def_readwrite("repeat_last_n", &SamplerParams::repeat_last_n)
        .def_property_readonly("penalty_on", &penalty_on);

    py::class_<Rng>(m, "Rng")
        .def(py::init<uint64_t>(), py::arg("seed"))
        .def("next", &Rng::next)
        .def("uniform", &Rng::uniform);

    m.def("route_log", [](uintptr_t callback, bool debug) {
        log_route.next.store(reinterpret_cast<ggml_log_callback>(callback));
        log_route.debug.store(debug);
        llama_log_set(&filtered_log, nullptr);
    }, py::arg("callback"), py::arg("debug"),
          "Send llama.cpp's log to a C callback (a ctypes function's address), debug lines only if `debug`.");
    m.def("argmax", [](FloatArray x) { return argmax(x.data(), static_cast<int>(x.size())); }, py::arg("logits"));
    m.def("top_share_reaches", [](FloatArray logits, int32_t x, double p_min) {
        if (x < 0 || x >= logits.size()) throw std::invalid_argument("token id out of range");
        return top_share_reaches(logits.data(), static_cast<int>(logits.size()), x, p_min);
    }, py::arg("logits"), py::arg("token"), py::arg("p_min"));
    m.def("distribution", &py_distribution, py::arg("logits"), py::arg("history"), py::arg("params"));
    m.def("sample_dense", [](FloatArray probs, double u) {
        std::vector<float> v(probs.data(), probs.data() + probs.size());
        return sample_dense(v, u);
    });
    m.def("verify", &py_verify, py::arg("rows"), py::arg("drafts"), py::arg("q"), py::arg("history"),
          py::arg("params"), py::arg("rule"), py::arg("rng"), py::arg("grammar") = nullptr);
    m.def("sample_context", [](uintptr_t ctx, int idx, const std::vector<int32_t>& history,
                               const SamplerParams& p, Rng& rng, Grammar* grammar) {
        const llama_token t = sample_context(as_ctx(ctx), idx, history, p, rng, grammar);
        if (t < 0) throw std::runtime_error("no logits to sample from");
        return t;
    }, py::arg("ctx"), py::arg("idx"), py::arg("history"), py::arg("params"), py::arg("rng"),
       py::arg("grammar") = nullptr);
    bind_grammar(m);
    bind_round(m);

    py::class_<ImatrixCollector>(m, "ImatrixCollector")
        .def(py::init<>())
        .def_property_readonly("callback_address", [](const ImatrixCollector&) {
            return reinterpret_cast<uintptr_t>(&ImatrixCollector::eval_callback);
        })
        .def_property_readonly("user_data", [](ImatrixCollector& c) { return reinterpret_cast<uintptr_t>(&c); })
        .def_property_readonly("error", &ImatrixCollector::error)
        .def("set_capture", &ImatrixCollector::set_capture, py::arg("node_name"))
        .def("results", &imatrix_results)
        .def("captured", &imatrix_captured)
        .def("reset", &ImatrixCollector::reset);
    m.def("quant_error", &py_quant_error, py::arg("type"), py::arg("weights"), py::arg("importance"),
          py::arg("n_threads") = 1);
    m.def("gguf_tensors", &gguf_tensors, py::arg("path"));
    m.def("quantize_model", &py_quantize_model, py::arg("src"), py::arg("dst"), py::arg("ftype"), py::arg("n_threads"),
          py::arg("allow_requantize"), py::arg("overrides"), py::arg("imatrix"), py::arg("progress_fd") = -1);
}
