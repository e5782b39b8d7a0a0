"""llama.cpp model and context through llama-cpp-python's low-level API.

One owner per native handle (model, context, batch, sampler), each a context manager with a
deterministic close. Nothing here relies on __del__."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np

from edgerun.errors import ConfigError, EngineError
from edgerun.models.gguf_check import GGUFInfo, inspect
from edgerun.runtime import llama_log
from edgerun.runtime.graphs import CapturedGraphs
from edgerun.settings import EngineSettings

llama_log.install()
llama_cpp.llama_backend_init()


class Model:
    """Owns a llama_model*. Validated with gguf-py before llama.cpp sees the file."""

    def __init__(self, path: str | Path, *, n_gpu_layers: int = 0, info: GGUFInfo | None = None,
                 vocab_only: bool = False, devices: list[int] | None = None,
                 tensor_split: tuple[float, ...] | None = None, repack: bool = True):
        """devices: the ggml devices to offload to, in order (None: llama.cpp picks every local
        GPU); tensor_split: the share of offloaded layers per device (runtime/placement.py);
        repack: llama.cpp's repacked CPU weights (faster x86 kernels, other rounding)."""
        self.info = info or inspect(path)
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        params.use_extra_bufts = repack
        if devices is not None:  # NULL-terminated; llama.cpp copies the list while it loads
            keep_devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            params.devices = ctypes.cast(keep_devices, ctypes.c_void_p)
        if tensor_split is not None:  # llama.cpp reads llama_max_devices() floats
            keep_split = (ctypes.c_float * llama_cpp.llama_max_devices())(*tensor_split)
            params.tensor_split = keep_split
        self.n_gpu_layers = n_gpu_layers
        self.ptr = llama_cpp.llama_model_load_from_file(str(self.info.path).encode(), params)
        if not self.ptr:
            raise EngineError(f"{self.info.path}: llama.cpp could not load the model (see the log with -v)")
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.ptr)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        # token -> bytes, per `special`: a vocabulary never changes, and the server asks from
        # several threads at once (the engine's replies, request threads' BOS/EOS), so no call
        # may share a result buffer with another
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def bos(self) -> int:
        return llama_cpp.llama_vocab_bos(self.vocab)

    @property
    def eos(self) -> int:
        return llama_cpp.llama_vocab_eos(self.vocab)

    @property
    def eot(self) -> int:
        return llama_cpp.llama_vocab_eot(self.vocab)

    def token_text(self, token: int) -> bytes:
        return llama_cpp.llama_vocab_get_text(self.vocab, token) or b""

    @property
    def vocab_type(self) -> int:
        return llama_cpp.llama_vocab_type(self.vocab)

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise EngineError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character)."""
        known = self._pieces[special]
        if (data := known.get(token)) is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            data = known[token] = buf.raw[:n]
        return data


class Batch:
    """Owns a llama_batch of n_batch tokens, each of one sequence (several sequences may share it)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.raw = llama_cpp.llama_batch_init(capacity, 0, 1)
        self._closed = False

    def fill_rows(self, rows: list[tuple[int, list[int], int, bool]]) -> list[int]:
        """Several sequences in one batch: (seq, tokens, first position, logits for the last
        token) per row. Returns each row's batch index of its last token."""
        b = self.raw
        n = sum(len(tokens) for _, tokens, _, _ in rows)
        if n > self.capacity:
            raise ValueError(f"batch of {n} tokens exceeds capacity {self.capacity}")
        i, last = 0, []
        for seq, tokens, pos, logits in rows:
            for j, tok in enumerate(tokens):
                b.token[i] = tok
                b.pos[i] = pos + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = False
                i += 1
            b.logits[i - 1] = logits
            last.append(i - 1)
        b.n_tokens = n
        return last

    def fill(self, tokens: list[int], start_pos: int, *, seq: int = 0, all_logits: bool = False) -> None:
        """One sequence's tokens from start_pos on; logits for the last (for every one with all_logits)."""
        self.fill_rows([(seq, tokens, start_pos, True)])
        if all_logits:
            for i in range(len(tokens)):
                self.raw.logits[i] = True

    def close(self) -> None:
        if not self._closed:
            llama_cpp.llama_batch_free(self.raw)
            self._closed = True

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class KvSequence:
    """What the KV cache holds for one sequence id, position by position."""

    tokens: list[int] = field(default_factory=list)
    in_flight: bool = False  # one decode past `tokens` launched by the native round, its pick not read


class Context:
    """Owns a llama_context* and its batch, and is the one writer of what its KV cache holds per
    sequence (its own evals and trims, and the native round's writes through commit), so a new
    prompt that extends the last one (a chat turn) evaluates only the new part. With
    settings.n_seq > 1 the sequences 0..n_seq-1 each get a KV stream of n_ctx cells of their own,
    as llama-server's slots do. Not one unified cache: llama.cpp's CPU flash attention takes the
    queries of a batch as tiles and skips a block of cells only when every query in the tile masks
    it, so in a unified cache each of 16 decoding sequences attended over all 16 sequences' cells
    (the cache's used extent), against only its own in a stream."""

    def __init__(self, model: Model, settings: EngineSettings, *, eval_callback: tuple[int, int] | None = None):
        """eval_callback: (function address, user data address) of a ggml_backend_sched_eval_callback
        that sees the graph's nodes (the native imatrix collector); its owner must outlive the context."""
        self.model = model
        params = llama_cpp.llama_context_default_params()
        if eval_callback is not None:
            params.cb_eval = llama_cpp.ggml_backend_sched_eval_callback(eval_callback[0])
            params.cb_eval_user_data = ctypes.c_void_p(eval_callback[1])
        params.n_ctx = settings.n_ctx * settings.n_seq
        params.n_seq_max = settings.n_seq
        params.kv_unified = False  # a stream per sequence (see above)
        params.n_batch = settings.n_batch
        params.n_ubatch = min(settings.n_ubatch, settings.n_batch)
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        params.no_perf = True
        # a greedy pick in the graph (greedy_on_device) may pick every output of a batch: a round
        # of n-gram proposals verifies by the pick of each row (llama.cpp's default is one a sequence)
        params.n_outputs_max_per_seq = 0
        self.ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise EngineError(f"llama.cpp could not create a context of {settings.n_ctx} tokens (out of memory?)")
        self.n_cells = llama_cpp.llama_n_ctx(self.ptr)
        self.n_ctx = self.n_cells // settings.n_seq  # the positions one sequence may hold
        self.n_batch = llama_cpp.llama_n_batch(self.ptr)  # llama.cpp caps it at n_ctx
        self.batch = Batch(self.n_batch)
        self.mem = llama_cpp.llama_get_memory(self.ptr)
        self._seqs = {seq: KvSequence() for seq in range(settings.n_seq)}
        self._device_greedy = None  # the sampler chain llama.cpp runs in the graph, while attached
        # the decode shapes ggml-cuda has captured, where the whole model runs on a GPU with graphs on
        graphs_on = self.output_on_gpu and not os.environ.get("GGML_CUDA_DISABLE_GRAPHS")
        self.graphs: CapturedGraphs | None = CapturedGraphs(self.n_ctx) if graphs_on else None

    def close(self) -> None:
        if self.ptr:
            self.batch.close()
            llama_cpp.llama_free(self.ptr)
            self.ptr = None
        if self._device_greedy is not None:  # after the context: it points to the chain
            llama_cpp.llama_sampler_free(self._device_greedy)
            self._device_greedy = None

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def address(self) -> int:
        """The raw llama_context* for the native extension (which never frees it)."""
        return ctypes.cast(self.ptr, ctypes.c_void_p).value

    def _seq(self, seq: int) -> KvSequence:
        try:
            return self._seqs[seq]
        except KeyError:
            raise EngineError(f"sequence {seq} is not open in this context") from None

    def held(self, seq: int = 0) -> list[int]:
        """What the KV cache holds for a sequence (read it; only the context changes it)."""
        return self._seq(seq).tokens

    @property
    def tokens(self) -> list[int]:
        return self._seqs[0].tokens

    @property
    def n_past(self) -> int:
        return len(self._seqs[0].tokens)

    @property
    def n_seq(self) -> int:
        return len(self._seqs)

    def in_flight(self, seq: int = 0) -> bool:
        return self._seq(seq).in_flight

    def trim(self, n_keep: int, seq: int = 0) -> None:
        """Drop KV cache entries from position n_keep on."""
        self.land(seq)
        tokens = self._seq(seq).tokens
        if n_keep < len(tokens):
            if not llama_cpp.llama_memory_seq_rm(self.mem, seq, n_keep, -1):
                raise EngineError("llama.cpp could not trim the KV cache")
            del tokens[n_keep:]

    def eval(self, tokens: list[int], *, all_logits: bool = False, seq: int = 0) -> None:
        """Append tokens to the KV cache, n_batch at a time; logits for the last token (for
        every token with all_logits)."""
        self.land(seq)
        held = self._seq(seq).tokens
        if len(held) + len(tokens) > self.n_ctx:
            raise ConfigError(
                f"context is full ({len(held)} + {len(tokens)} tokens > {self.n_ctx});"
                " start a new conversation or raise --ctx"
            )
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            self.batch.fill(chunk, len(held), seq=seq, all_logits=all_logits)
            rc = llama_cpp.llama_decode(self.ptr, self.batch.raw)
            if rc != 0:
                raise EngineError(f"llama_decode failed with code {rc}")
            held.extend(chunk)
            self.ran(len(chunk), len(chunk) if all_logits else 1, len(held))

    def ran(self, tokens: int, outputs: int, end: int) -> None:
        """Count one decode of `tokens` tokens (`outputs` of them with logits) that filled the
        sequence's cells up to `end`, in the mirror of captured graphs (the native round's decodes
        are counted by commit, from what the round reports)."""
        if self.graphs is not None:
            self.graphs.ran(tokens, outputs, end, self.picks_on_device)

    def cold_verify_sizes(self, most: int, seq: int = 0) -> frozenset[int]:
        """The verify sizes (drafts + 1, up to most + 1) of a round on `seq` whose batch would not
        replay a captured CUDA graph now (CapturedGraphs.cold_verify_sizes); none where graphs are
        not in play (a CPU)."""
        if self.graphs is None:
            return frozenset()
        s = self._seq(seq)
        return self.graphs.cold_verify_sizes(len(s.tokens), int(s.in_flight), most, self.picks_on_device)

    def decode_rows(self, rows: list[tuple[int, list[int], bool]]) -> list[int]:
        """One llama_decode of several sequences' tokens: (seq, tokens, logits for the last one)
        per row, each appended at its sequence's end. Returns each row's output index (for
        logits and _native.sample_context), in the order of `rows`. The batch holds the rows by
        sequence id: with a stream per sequence llama.cpp puts consecutive ids in one ubatch."""
        order = sorted(range(len(rows)), key=lambda r: rows[r][0])
        placed = []
        for r in order:
            seq, tokens, logits = rows[r]
            self.land(seq)
            held = self._seq(seq).tokens
            if len(held) + len(tokens) > self.n_ctx:
                raise ConfigError(f"sequence {seq} is full ({len(held)} + {len(tokens)} tokens > {self.n_ctx})")
            placed.append((seq, tokens, len(held), logits))
        last = [0] * len(rows)
        for r, i in zip(order, self.batch.fill_rows(placed)):
            last[r] = i
        rc = llama_cpp.llama_decode(self.ptr, self.batch.raw)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc}" + (" (no free KV cells)" if rc == 1 else ""))
        for seq, tokens, _ in rows:
            self._seqs[seq].tokens.extend(tokens)
        return last

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make sequence dst hold the first n tokens of src. Between streams llama.cpp copies a
        whole stream's buffer (at the next decode), then dst drops what lies past n."""
        self.land(src)
        self.trim(0, dst)
        if n:
            llama_cpp.llama_memory_seq_cp(self.mem, src, dst, -1, -1)  # across streams: whole ones only
            self._seq(dst).tokens.extend(self._seq(src).tokens)
            self.trim(n, dst)

    def commit(self, seq: int, write, drafted: int = 0) -> None:
        """Record what a native round left in this KV (a _native.KvWrite): the tokens it kept
        from `pos` on, trimming the positions it decoded but does not keep (rejected drafts),
        and whether it left one more decode in flight. `drafted`: the drafts it verified (in one
        batch with `last`, unless `last` was in flight; else the round decoded a token at a time)."""
        s = self._seq(seq)
        if write.pos != len(s.tokens):
            raise EngineError(f"a round wrote sequence {seq} from position {write.pos}, but it holds"
                              f" {len(s.tokens)} tokens; start a new conversation")
        if self.graphs is not None:
            pos, kept, first = write.pos, len(write.kept), int(s.in_flight)
            if drafted:
                self.ran(drafted + 1 - first, drafted + 1 - first, pos + drafted + 1)
            else:
                for end in range(pos + 1 + first, pos + kept + 1):
                    self.ran(1, 1, end)
            if write.in_flight:
                self.ran(1, 1, pos + kept + 1)
        s.tokens.extend(write.kept)  # in place: no copy of the whole context per round
        s.in_flight = write.in_flight
        if write.dropped and not llama_cpp.llama_memory_seq_rm(self.mem, seq, len(s.tokens), -1):
            raise EngineError("llama.cpp could not trim the KV cache")

    def land(self, seq: int = 0) -> None:
        """Drop a decode the native round left in flight, once llama.cpp is done with it."""
        if self._seq(seq).in_flight:
            self.drop_unrecorded(seq)

    def drop_unrecorded(self, seq: int = 0) -> None:
        """Make the KV hold only the recorded tokens: drop a decode left in flight, or what a
        failed round decoded past them, once llama.cpp is done with it."""
        s = self._seq(seq)
        llama_cpp.llama_synchronize(self.ptr)
        llama_cpp.llama_memory_seq_rm(self.mem, seq, len(s.tokens), -1)
        s.in_flight = False

    def state_bytes(self, seq: int = 0) -> bytearray:
        """llama.cpp's serialized KV cache of one sequence: exactly the positions held(seq) lists
        (a decode left in flight is dropped first). For runtime/kvstate.py to keep on disk."""
        self.land(seq)
        llama_cpp.llama_synchronize(self.ptr)
        size = llama_cpp.llama_state_seq_get_size(self.ptr, seq)
        data = bytearray(size)
        n = llama_cpp.llama_state_seq_get_data(self.ptr, (ctypes.c_uint8 * size).from_buffer(data), size, seq)
        if n == 0 or n > size:
            raise EngineError("llama.cpp could not serialize the KV cache; run with -v to see its log")
        del data[n:]
        return data

    def restore_state(self, data: bytearray | memoryview, tokens: list[int], seq: int = 0) -> None:
        """Make the sequence hold `tokens` from a state_bytes() payload. Raises EngineError when
        llama.cpp refuses the payload or it does not hold exactly positions 0..len(tokens)-1;
        the sequence is empty then."""
        self.trim(0, seq)
        if not tokens or not data:
            raise EngineError("a saved KV state holds no tokens")
        n = llama_cpp.llama_state_seq_set_data(self.ptr, (ctypes.c_uint8 * len(data)).from_buffer(data),
                                              len(data), seq)
        first = llama_cpp.llama_memory_seq_pos_min(self.mem, seq)
        last = llama_cpp.llama_memory_seq_pos_max(self.mem, seq)
        if n != len(data) or first != 0 or last != len(tokens) - 1:
            llama_cpp.llama_memory_seq_rm(self.mem, seq, -1, -1)
            why = ("llama.cpp refused it" if n == 0 else
                   f"llama.cpp read {n} of its {len(data)} bytes" if n != len(data) else
                   f"it holds positions {first}..{last}, not 0..{len(tokens) - 1}")
            raise EngineError(f"the saved KV state does not fit this context ({why})")
        self._seq(seq).tokens.extend(tokens)

    def shared_prefix(self, tokens: list[int], seq: int = 0) -> int:
        """How many leading tokens of `tokens` the cache already holds."""
        return common_prefix(self._seq(seq).tokens, tokens)

    def sync(self, tokens: list[int], *, need_logits: bool = False, seq: int = 0) -> int:
        """Make the cache hold exactly `tokens`, reusing the longest common prefix; with
        need_logits the last token is evaluated even if cached. Returns how many were evaluated."""
        keep = common_prefix(self._seq(seq).tokens, tokens)
        if need_logits:
            keep = min(keep, len(tokens) - 1)
        self.trim(keep, seq)
        if keep < len(tokens):
            self.eval(tokens[keep:], seq=seq)
        return len(tokens) - keep

    def prefill(self, prompt: list[int], seq: int = 0) -> int:
        """Make the cache hold `prompt` with the logits of its last token ready."""
        return self.sync(prompt, need_logits=True, seq=seq)

    @property
    def output_on_gpu(self) -> bool:
        """llama.cpp puts the output layer on the GPU once n_gpu_layers exceeds the block count."""
        return self.model.n_gpu_layers > self.model.info.n_layers > 0

    @property
    def picks_on_device(self) -> bool:
        return self._device_greedy is not None

    def greedy_on_device(self, on: bool) -> bool:
        """Attach (or detach) a greedy pick inside llama.cpp's graph. While attached, a decode
        copies one token id per output back (read by the native round) instead of rows of n_vocab
        logits, and logits() refuses: only greedy replies whose rounds need no more than the pick
        run with it (plain ones, and n-gram ones: RoundPlan.picked). With the output
        layer on a GPU that saves the logits' copy and the host's read of them (about 1% of a
        0.5B step on an H200). The next decode after a change re-plans llama.cpp's graph.
        Returns whether it is attached."""
        if on == (self._device_greedy is not None):
            return on
        if self.graphs is not None:
            self.graphs.forget()  # llama.cpp plans its graphs anew: none replays what was captured
        if not on:
            llama_cpp.llama_set_sampler(self.ptr, 0, None)
            llama_cpp.llama_sampler_free(self._device_greedy)
            self._device_greedy = None
            return False
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        if not llama_cpp.llama_set_sampler(self.ptr, 0, chain):  # this backend cannot: pick on the host
            llama_cpp.llama_sampler_free(chain)
            return False
        self._device_greedy = chain
        return True

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of output i of the last decode (-1: the last), as a NumPy view (no copy)."""
        ptr = llama_cpp.llama_get_logits_ith(self.ptr, i) if self._device_greedy is None else None
        if not ptr:
            raise EngineError(f"no logits for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))


def common_prefix(a, b) -> int:
    """Length of the shared prefix. The usual case, a cache that is a prefix of the new tokens
    (the next chat turn, a draft catching up), is one list comparison in C."""
    n = len(a)
    if n <= len(b) and b[:n] == a:
        return n
    keep = 0
    for x, y in zip(a, b):
        if x != y:
            break
        keep += 1
    return keep
