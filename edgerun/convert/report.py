"""How good a quantized GGUF is: the same held-out tokens through the reference and the quantized
model with llama.cpp, compared position by position over the full vocabulary.

Scoring follows llama.cpp's perplexity tool: the text is cut into chunks of n_ctx tokens (BOS
first where the model wants one) and only the second half of each chunk is scored, so every scored
position has at least n_ctx/2 tokens of context. At each scored position:
    KL(ref || quant) = sum_v p_ref(v) * (log p_ref(v) - log p_quant(v))
top-1 agreement is argmax p_ref == argmax p_quant, and perplexity is exp(mean -log p(next token))."""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from edgerun.convert.atomic import atomic_path
from edgerun.errors import ConvertError

Progress = Callable[[str, int, int], None]
_ROWS = 64  # positions per block of the KL math: bounds the float temporaries to ~40 MB each


@dataclass(frozen=True)
class Quality:
    kld_mean: float
    kld_p99: float
    kld_max: float
    top1_agreement: float
    ppl: float
    ppl_ref: float
    n_positions: int
    n_chunks: int


def evaluate(ref_gguf: Path, quant_gguf: Path, text: str, *, n_ctx: int = 512,
             max_chunks: int | None = None, n_threads: int | None = None,
             progress: Progress | None = None) -> Quality:
    """Compare `quant_gguf` against `ref_gguf` on `text` (see the module docstring)."""
    return evaluate_many(ref_gguf, [quant_gguf], text, n_ctx=n_ctx, max_chunks=max_chunks,
                         n_threads=n_threads, progress=progress)[0]


def evaluate_many(ref_gguf: Path, quant_ggufs: Sequence[Path], text: str, *, n_ctx: int = 512,
                  max_chunks: int | None = None, n_threads: int | None = None,
                  progress: Progress | None = None) -> list[Quality]:
    """evaluate() for several quantizations of one reference: the reference runs once per chunk."""
    from edgerun.runtime.engine import Context, Model
    from edgerun.settings import EngineSettings

    engine = EngineSettings().replace(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=n_threads)
    with contextlib.ExitStack() as stack:
        ref = stack.enter_context(Model(ref_gguf))
        ref_ctx = stack.enter_context(Context(ref, engine))
        quant_ctxs = []
        for path in quant_ggufs:
            quant = stack.enter_context(Model(path))
            if quant.n_vocab != ref.n_vocab:
                raise ConvertError(f"{path} has {quant.n_vocab} tokens but the reference has {ref.n_vocab}; "
                                   "compare a model only with its own quantizations")
            quant_ctxs.append(stack.enter_context(Context(quant, engine)))
        chunks = _chunks(ref, text, n_ctx, max_chunks)
        accs = [_Accumulator() for _ in quant_ctxs]
        first = n_ctx // 2
        for i, chunk in enumerate(chunks):
            if progress:
                progress("evaluate", i, len(chunks))
            ref_logits = _chunk_logits(ref_ctx, chunk, first)
            targets = np.asarray(chunk[first + 1:])
            for acc, ctx in zip(accs, quant_ctxs):
                acc.add(ref_logits, _chunk_logits(ctx, chunk, first), targets)
        if progress:
            progress("evaluate", len(chunks), len(chunks))
    return [acc.result(len(chunks)) for acc in accs]


class Reference:
    """The reference model's logits on a text, computed once, then compared with quantizations one
    at a time (only one quantized model is loaded at once). Holds chunks x scored positions x
    n_vocab floats: meant for a few chunks (about 150 MB per 256 positions of a 152K vocabulary).
    `first`: the first scored position of each chunk (default n_ctx/2, as evaluate() scores);
    an earlier one scores more of each chunk's tokens, with less context behind the first few."""

    def __init__(self, ref_gguf: Path, text: str, *, n_ctx: int = 512, max_chunks: int | None = None,
                 n_threads: int | None = None, first: int | None = None,
                 known: Sequence[tuple[list[int], np.ndarray]] = ()):
        """`known`: (tokens, logits from `first` on) of chunks already run through the reference
        (by calibration); a chunk whose tokens match is not run again."""
        from edgerun.runtime.engine import Context, Model
        from edgerun.settings import EngineSettings

        self.engine = EngineSettings().replace(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=n_threads)
        self.first = n_ctx // 2 if first is None else first
        self._terms: list[tuple[np.ndarray, np.ndarray]] | None = None  # kld_mean's reference side, made once
        if not 0 <= self.first < n_ctx - 1:
            raise ConvertError(f"the first scored position {self.first} is outside a chunk of {n_ctx} tokens")
        with Model(ref_gguf) as ref:
            self.n_vocab = ref.n_vocab
            self.chunks = _chunks(ref, text, n_ctx, max_chunks)
            self.logits = []
            for i, chunk in enumerate(self.chunks):
                tokens, logits = known[i] if i < len(known) else (None, None)
                fits = tokens == chunk and logits is not None and len(logits) == len(chunk) - 1 - self.first
                self.logits.append(logits if fits else None)
            if any(x is None for x in self.logits):
                with Context(ref, self.engine) as ctx:
                    self.logits = [x if x is not None else _chunk_logits(ctx, chunk, self.first)
                                   for x, chunk in zip(self.logits, self.chunks)]

    def compare(self, quant_gguf: Path) -> Quality:
        from edgerun.runtime.engine import Context, Model

        acc = _Accumulator()
        with Model(quant_gguf) as quant, Context(quant, self.engine) as ctx:
            self._check_vocab(quant_gguf, quant)
            for chunk, ref_logits in zip(self.chunks, self.logits):
                acc.add(ref_logits, _chunk_logits(ctx, chunk, self.first), np.asarray(chunk[self.first + 1:]))
        return acc.result(len(self.chunks))

    def kld_mean(self, quant_gguf: Path, *, info=None) -> float:
        """compare()'s mean KLD alone, at a fraction of its math: the reference's side (its
        log-normalizer and probabilities) is computed once, and each position's
            KL = sum_v p_ref(v) (log p_ref(v) - log p_quant(v)) = lse_quant - lse_ref - sum_v p_ref(v) (q_v - r_v)
        takes one exp pass over the quantization's logits, read where llama.cpp left them (no
        copy). `info`: the file's already validated GGUFInfo (a probe spliced from validated
        files), else it is validated here."""
        from edgerun.runtime.engine import Context, Model

        terms = self._kl_terms()
        total, n = 0.0, 0
        with Model(quant_gguf, info=info) as quant, Context(quant, self.engine) as ctx:
            self._check_vocab(quant_gguf, quant)
            for chunk, ref, (probs, lse_ref) in zip(self.chunks, self.logits, terms):
                ctx.trim(0)
                ctx.eval(chunk, all_logits=True)
                logits = _logits_view(ctx, len(chunk), self.first)
                for s in range(0, len(ref), _ROWS):
                    q = logits[s:s + _ROWS]
                    cross = (probs[s:s + _ROWS] * (q - ref[s:s + _ROWS])).sum(axis=1)
                    kl = _logsumexp(q) - lse_ref[s:s + _ROWS] - cross
                    total += float(np.maximum(kl, 0.0).sum())
                    n += len(kl)
        return total / n

    def _kl_terms(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per chunk, the reference's probabilities (float32) and log-normalizers (float64)."""
        if self._terms is None:
            self._terms = []
            for ref in self.logits:
                lse = np.concatenate([_logsumexp(ref[s:s + _ROWS]) for s in range(0, len(ref), _ROWS)])
                self._terms.append((np.exp(ref - lse[:, None].astype(np.float32)), lse))
        return self._terms

    def _check_vocab(self, path: Path, quant) -> None:
        if quant.n_vocab != self.n_vocab:
            raise ConvertError(f"{path} has {quant.n_vocab} tokens but the reference has {self.n_vocab}; "
                               "compare a model only with its own quantizations")


def _chunks(model, text: str, n_ctx: int, max_chunks: int | None) -> list[list[int]]:
    tokens = model.tokenize(text, add_special=False, parse_special=False)
    body = n_ctx - 1 if model.add_bos else n_ctx
    n = len(tokens) // body
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n == 0:
        raise ConvertError(f"the evaluation text has {len(tokens)} tokens, fewer than one chunk of {n_ctx}; "
                           "use a longer text")
    head = [model.bos] if model.add_bos else []
    return [head + tokens[i * body:(i + 1) * body] for i in range(n)]


def _chunk_logits(ctx, tokens: list[int], first: int) -> np.ndarray:
    """Logits at positions first .. len-2 (each predicts the next token), evaluated on an empty
    cache in one llama_decode."""
    ctx.trim(0)
    ctx.eval(tokens, all_logits=True)
    return evaluated_logits(ctx, len(tokens), first)


def evaluated_logits(ctx, n_tokens: int, first: int) -> np.ndarray:
    """A copy of the logits at positions first .. n_tokens-2 of the chunk the context has just
    evaluated with every position's logits."""
    return _logits_view(ctx, n_tokens, first).copy()


def _logits_view(ctx, n_tokens: int, first: int) -> np.ndarray:
    """evaluated_logits() without the copy: valid until the context's next decode."""
    import llama_cpp

    # with every position flagged, llama_get_logits holds one row per token, in batch order
    ptr = llama_cpp.llama_get_logits(ctx.ptr)
    return np.ctypeslib.as_array(ptr, shape=(n_tokens, ctx.model.n_vocab))[first:-1]


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """Per row log(sum(exp(x))), float64 (the sum itself in float32, pairwise)."""
    top = x.max(axis=1, keepdims=True)
    return top[:, 0].astype(np.float64) + np.log(np.exp(x - top).sum(axis=1).astype(np.float64))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@dataclass
class _Accumulator:
    kld: list[np.ndarray] = field(default_factory=list)
    agree: int = 0
    nll: float = 0.0
    nll_ref: float = 0.0
    n: int = 0

    def add(self, ref: np.ndarray, quant: np.ndarray, targets: np.ndarray) -> None:
        for s in range(0, len(ref), _ROWS):
            r, q, t = ref[s:s + _ROWS], quant[s:s + _ROWS], targets[s:s + _ROWS]
            lr, lq = _log_softmax(r), _log_softmax(q)
            self.kld.append(np.maximum((np.exp(lr) * (lr - lq)).sum(axis=1, dtype=np.float64), 0.0))
            self.agree += int((r.argmax(axis=1) == q.argmax(axis=1)).sum())
            rows = np.arange(len(t))
            self.nll -= float(lq[rows, t].sum(dtype=np.float64))
            self.nll_ref -= float(lr[rows, t].sum(dtype=np.float64))
            self.n += len(t)

    def result(self, n_chunks: int) -> Quality:
        kld = np.concatenate(self.kld)
        return Quality(kld_mean=float(kld.mean()), kld_p99=float(np.percentile(kld, 99)),
                       kld_max=float(kld.max()), top1_agreement=self.agree / self.n,
                       ppl=math.exp(self.nll / self.n), ppl_ref=math.exp(self.nll_ref / self.n),
                       n_positions=self.n, n_chunks=n_chunks)


def write_text_atomic(path: Path, text: str) -> None:
    """Temp file in the same directory, fsynced, then renamed; on any exception (Ctrl-C too) no trace."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


# --- the report of one conversion ---

@dataclass(frozen=True)
class TensorInfo:
    type: str
    bytes: int
    shape: tuple[int, ...]


def describe(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of a GGUF: its type, bytes and shape (GGUF order: row length first)."""
    from edgerun.convert.tensors import n_bytes, open_gguf

    return {t.name: TensorInfo(t.tensor_type.name, n_bytes(t), tuple(int(d) for d in t.shape))
            for t in open_gguf(path).tensors}


@dataclass(frozen=True)
class Report:
    output: str
    size_bytes: int
    n_elements: int
    tensor_bytes: int
    tensors: dict[str, TensorInfo]
    quality: Quality | None = None
    details: dict = field(default_factory=dict)  # budget, plan, calibration, timings

    @property
    def bpw(self) -> float:
        """llama.cpp's bits per weight: all tensor bytes * 8 / all elements."""
        return 8 * self.tensor_bytes / self.n_elements

    def to_json(self) -> dict:
        q = asdict(self.quality) if self.quality else dict.fromkeys(
            ("kld_mean", "kld_p99", "kld_max", "top1_agreement", "ppl", "ppl_ref", "n_positions", "n_chunks"))
        return {"output": self.output, "size_bytes": self.size_bytes, "bpw": self.bpw,
                "n_elements": self.n_elements, "tensor_bytes": self.tensor_bytes, **q,
                "tensors": {n: {"type": t.type, "bytes": t.bytes} for n, t in self.tensors.items()},
                **self.details}

    def write(self, path: Path) -> None:
        """The JSON document, atomically (a reader never sees half a file)."""
        write_text_atomic(Path(path), json.dumps(self.to_json(), indent=2) + "\n")

    def table(self) -> str:
        """The terminal report: summary, quality, and the type of every weight tensor."""
        lines = [f"{self.output}: {self.size_bytes / 1e6:,.1f} MB, {self.bpw:.3f} bpw"]
        if "budget_bytes" in self.details:
            lines.append(f"tensor budget {self.details['budget_bytes'] / 1e6:,.1f} MB, "
                         f"used {self.tensor_bytes / 1e6:,.1f} MB")
        q = self.quality
        if q:
            lines.append(f"vs reference on {q.n_positions} held-out positions: mean KLD {q.kld_mean:.5f} "
                         f"(p99 {q.kld_p99:.4f}), top-1 agreement {q.top1_agreement:.2%}, "
                         f"perplexity {q.ppl:.3f} (reference {q.ppl_ref:.3f})")
        if self.details.get("stock"):
            from edgerun.convert.plot import text_chart

            lines += ["", "against llama.cpp's stock recipes (same imatrix; bar: log mean KLD):",
                      *text_chart(self.to_json())]
        lines += ["", *type_table(self.tensors)]
        return "\n".join(lines)


# A report's headline figures: what the registry of converted models keeps of it, and what the
# report keeps of each stock recipe it was compared with.
SUMMARY_KEYS = ("size_bytes", "bpw", "kld_mean", "kld_p99", "top1_agreement", "ppl", "ppl_ref")


def summary(doc: dict) -> dict:
    """SUMMARY_KEYS of a report's JSON document (None where not measured)."""
    return {k: doc.get(k) for k in SUMMARY_KEYS}


def build(path: Path, quality: Quality | None = None, **details) -> Report:
    tensors = describe(path)
    return Report(output=str(path), size_bytes=Path(path).stat().st_size,
                  n_elements=sum(math.prod(t.shape) for t in tensors.values()),
                  tensor_bytes=sum(t.bytes for t in tensors.values()), tensors=tensors,
                  quality=quality, details=details)


_LAYER = re.compile(r"^blk\.(\d+)\.(.+?)(?:\.weight)?$")


def type_table(tensors: dict[str, TensorInfo]) -> list[str]:
    """One row per layer, one column per kind of weight; other weights listed after. Norms and
    biases (1-D) are left out."""
    layers: dict[int, dict[str, str]] = {}
    kinds: list[str] = []
    others = []
    for name, t in tensors.items():
        if len(t.shape) < 2:
            continue
        m = _LAYER.match(name)
        if not m:
            others.append(f"{name}: {t.type}")
            continue
        kind = m.group(2)
        if kind not in kinds:
            kinds.append(kind)
        layers.setdefault(int(m.group(1)), {})[kind] = t.type
    rows = [["layer", *kinds]] + [[str(i), *(layers[i].get(k, "-") for k in kinds)] for i in sorted(layers)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return others + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
