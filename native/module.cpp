// edgerun._native: the Python face of the speculative round and the sampling math.
// Python owns every llama.cpp handle and passes raw addresses in; nothing here frees them.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>

#include "round.hpp"
#include "sampling.hpp"

namespace py = pybind11;
using namespace edgerun;

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

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
                    const std::vector<int32_t>& history, const SamplerParams& p, const std::string& rule, Rng& rng) {
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
    const Verdict v = verify(ptrs, n_vocab, drafts, q, history, p, rule_of(rule), rng);
    return py::make_tuple(v.accepted, v.next);
}

py::dict py_round(uintptr_t target, uintptr_t draft, std::vector<llama_token> draft_feed, int draft_n_past,
                  llama_token last, int target_n_past, int k, float p_min, std::vector<llama_token> proposals,
                  std::vector<int32_t> history, const SamplerParams& p, const std::string& rule, Rng& rng) {
    RoundInput in;
    in.target = as_ctx(target);
    in.draft = draft ? as_ctx(draft) : nullptr;
    in.draft_feed = std::move(draft_feed);
    in.draft_n_past = draft_n_past;
    in.last = last;
    in.target_n_past = target_n_past;
    in.k = k;
    in.p_min = p_min;
    in.proposals = std::move(proposals);
    in.history = std::move(history);
    in.params = p;
    in.rule = rule_of(rule);
    if (in.draft && k > 0 && in.draft_feed.empty()) throw std::invalid_argument("draft_feed must end with last");
    RoundResult r;
    {
        py::gil_scoped_release release;  // the TUI keeps drawing while llama.cpp works
        r = run_round(in, rng);
    }
    if (!r.error.empty()) throw std::runtime_error(r.error);
    py::dict d;
    d["drafts"] = r.drafts;
    d["accepted"] = r.accepted;
    d["next"] = r.next;
    d["draft_evaluated"] = r.draft_evaluated;
    d["draft_s"] = r.draft_s;
    d["verify_s"] = r.verify_s;
    return d;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "edgerun's native hot path: the speculative round and the sampling math";

    py::class_<SamplerParams>(m, "SamplerParams")
        .def(py::init<>())
        .def_readwrite("temperature", &SamplerParams::temperature)
        .def_readwrite("top_k", &SamplerParams::top_k)
        .def_readwrite("top_p", &SamplerParams::top_p)
        .def_readwrite("min_p", &SamplerParams::min_p)
        .def_readwrite("repeat_penalty", &SamplerParams::repeat_penalty)
        .def_readwrite("repeat_last_n", &SamplerParams::repeat_last_n);

    py::class_<Rng>(m, "Rng")
        .def(py::init<uint64_t>(), py::arg("seed"))
        .def("next", &Rng::next)
        .def("uniform", &Rng::uniform);

    m.def("distribution", &py_distribution, py::arg("logits"), py::arg("history"), py::arg("params"));
    m.def("sample_dense", [](FloatArray probs, double u) {
        std::vector<float> v(probs.data(), probs.data() + probs.size());
        return sample_dense(v, u);
    });
    m.def("verify", &py_verify, py::arg("rows"), py::arg("drafts"), py::arg("q"), py::arg("history"),
          py::arg("params"), py::arg("rule"), py::arg("rng"));
    m.def("sample_context", [](uintptr_t ctx, int idx, const std::vector<int32_t>& history,
                               const SamplerParams& p, Rng& rng) {
        const llama_token t = sample_context(as_ctx(ctx), idx, history, p, rng);
        if (t < 0) throw std::runtime_error("no logits to sample from");
        return t;
    });
    m.def("round", &py_round, py::arg("target"), py::arg("draft"), py::arg("draft_feed"), py::arg("draft_n_past"),
          py::arg("last"), py::arg("target_n_past"), py::arg("k"), py::arg("p_min"), py::arg("proposals"),
          py::arg("history"), py::arg("params"), py::arg("rule"), py::arg("rng"));
}
