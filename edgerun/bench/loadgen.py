"""The load generator behind `edgerun bench load` and `edgerun bench serve`: drives any
OpenAI-compatible server (edgerun serve, llama-server, Ollama, vLLM) with the official `openai`
client.

Each concurrency level is a closed loop: C clients, each sending its next request when its
last one ends, until the level's requests are done. Every request is a streaming chat
completion at temperature 0 with a fixed max_tokens (`stream_options.include_usage`, so the
tokens counted are the server's own count, not the chunks). Per request: TTFT (send to first
content), TPOT ((last content - first content) / (tokens - 1)) and end-to-end latency; per
level their P50/P90/P99, and aggregate output tok/s and requests/s over the level's wall time
(first send to last answer). The default prompts ask for long replies ("... in 300 words"), so
replies run to max_tokens without asking the server to ignore EOS.

The long-prompt run (`--long-prompts TOKENS`) is chunked prefill's test: S short streams
decode in a closed loop while prompts of about TOKENS tokens arrive one after another. A server
that evaluates a long prompt in one go freezes every running stream for the whole prefill. The
figures are the running streams' TPOT P99 and their largest gap between tokens while a long
prompt was in flight (against their gaps before the first one), and the long requests' TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import secrets
import time
from dataclasses import dataclass, field

from edgerun.bench.stats import percentile
from edgerun.errors import ConfigError, EdgerunError

PROMPTS = (
    "Write a 300-word explanation of how a hash map handles collisions, with an example.",
    "In about 300 words, explain the difference between processes and threads.",
    "Write a 300-word short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in 300 words how TCP congestion control works, step by step.",
    "Write a 300-word guide to writing good unit tests, with concrete advice.",
    "In about 300 words, describe how a compiler turns source code into machine code.",
    "Write a 300-word essay on why version control matters for small teams.",
    "Explain in 300 words how public-key cryptography lets two strangers share a secret.",
)
LONG_ASK = "Summarize the records above in one sentence."
LONG_REPLY_TOKENS = 16  # the long requests' own replies: their TTFT is what is measured
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Target:
    """One server: its /v1 base URL, key and the model name requests carry."""
    base_url: str
    api_key: str
    model: str


@dataclass
class Outcome:
    """One request as the client saw it (perf_counter stamps)."""
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with content
    done: float = 0.0
    tokens: int = 0  # completion tokens: the server's usage, else the content chunks
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks and self.error is None else None

    @property
    def tpot(self) -> float | None:
        if self.error is not None or len(self.chunks) < 2 or self.tokens < 2:
            return None
        return (self.chunks[-1] - self.chunks[0]) / (self.tokens - 1)


def base_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--url takes http://HOST:PORT (or its /v1); '{url}' is not one")
    return url if url.endswith("/v1") else url + "/v1"


@functools.cache
def tls():
    """The SSL context every HTTP client of this process shares. httpx makes one per client it
    builds (the CA bundle read and parsed: about 35 ms of CPU), even for a client that only speaks
    http:// to 127.0.0.1, and a run builds a client per level and a probe per /health poll."""
    import httpx

    return httpx.create_ssl_context()


def connect(url: str, api_key: str | None, model: str | None, timeout: float = 10.0) -> Target:
    """Ask the server for its models: a server that does not answer is one line here, before
    any load is sent. Without --model, the first model the server lists."""
    import httpx

    base = base_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base + "/models", headers=headers, timeout=timeout, verify=tls())
    except httpx.HTTPError as exc:
        raise EdgerunError(f"no OpenAI-compatible server answers at {base} ({type(exc).__name__}: {exc});"
                           " start one or check --url") from exc
    if resp.status_code == 401:
        raise EdgerunError(f"{base} refused the request (401): give its key with --api-key")
    if resp.status_code != 200:
        raise EdgerunError(f"{base}/models answered {resp.status_code}; is this an OpenAI-compatible server?")
    try:
        names = [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise EdgerunError(f"{base}/models is not an OpenAI model list; is this an OpenAI-compatible server?") from exc
    if model is None and not names:
        raise EdgerunError(f"{base} lists no models; name one with --model")
    return Target(base, api_key or "none", model or names[0])


def client(target: Target, concurrency: int):
    import httpx
    from openai import AsyncOpenAI

    # a connection per request: a pooled one that the server closed after its last reply fails
    # the next request without a response (llama-server's does, now and then); on 127.0.0.1 a
    # new connection costs about a tenth of a millisecond
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    return AsyncOpenAI(base_url=target.base_url, api_key=target.api_key, max_retries=0, timeout=TIMEOUT_S,
                       http_client=httpx.AsyncClient(limits=limits, timeout=TIMEOUT_S, verify=tls()))


async def stream_one(api, target: Target, prompt: str, max_tokens: int) -> Outcome:
    """One streaming chat completion; a failure is recorded in the outcome, never raised."""
    import openai

    out = Outcome(sent=time.perf_counter())
    try:
        stream = await api.chat.completions.create(
            model=target.model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out.chunks.append(time.perf_counter())
            if chunk.usage is not None:
                out.tokens, out.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    except (openai.OpenAIError, OSError) as exc:
        cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        out.error = ((str(exc).strip().splitlines() or [type(exc).__name__])[0] + cause)[:300]
    out.done = time.perf_counter()
    if out.error is None and not out.tokens:
        out.tokens = len(out.chunks)  # a server that sends no usage
    return out


async def _closed_loop(target: Target, prompts: list[str], concurrency: int, requests: int,
                       max_tokens: int) -> tuple[list[Outcome], float]:
    outcomes: list[Outcome] = []
    next_index = iter(range(requests))

    async def worker(api) -> None:
        for i in next_index:  # one shared iterator: each request is taken once
            outcomes.append(await stream_one(api, target, prompts[i % len(prompts)], max_tokens))

    async with client(target, concurrency) as api:
        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(worker(api))
    return outcomes, time.perf_counter() - start


def _ms(values: list[float]) -> dict:
    return {f"p{q}": percentile(values, q) * 1000 if values else None for q in (50, 90, 99)}


def summarize(outcomes: list[Outcome], wall: float) -> dict:
    """A level's figures from its requests (pure)."""
    ok = [o for o in outcomes if o.error is None]
    failed = [o for o in outcomes if o.error is not None]
    tokens = sum(o.tokens for o in ok)
    return {"requests": len(outcomes), "ok": len(ok), "errors": len(failed),
            "first_error": failed[0].error if failed else None, "wall_s": wall,
            "completion_tokens": tokens, "output_tok_s": tokens / wall if wall > 0 else 0.0,
            "requests_s": len(ok) / wall if wall > 0 else 0.0,
            "ttft_ms": _ms([o.ttft for o in ok if o.ttft is not None]),
            "tpot_ms": _ms([o.tpot for o in ok if o.tpot is not None]),
            "e2e_ms": _ms([o.done - o.sent for o in ok]),
            "decode_tok_s": _median([1 / o.tpot for o in ok if o.tpot]),
            "mean_tokens": tokens / len(ok) if ok else 0.0}


def _median(values: list[float]) -> float | None:
    return percentile(values, 50) if values else None


def run_level(target: Target, prompts: list[str], concurrency: int, requests: int, max_tokens: int) -> dict:
    """One concurrency level against the server: its summary."""
    outcomes, wall = asyncio.run(_closed_loop(target, prompts, concurrency, requests, max_tokens))
    return {"concurrency": concurrency} | summarize(outcomes, wall)


def warm_up(target: Target, prompt: str) -> None:
    """One short request, not measured: the server pages its weights in."""
    outcomes, _ = asyncio.run(_closed_loop(target, [prompt], 1, 1, 8))
    if outcomes[0].error is not None:
        raise EdgerunError(f"{target.base_url}: the first request failed: {outcomes[0].error}")


# -- long prompts among running streams ------------------------------------------------------------


def _records(start: int, lines: int) -> str:
    return "\n".join(f"Record {i}: station {i % 37} read {i * 7 % 101} units at hour {i % 24}."
                     for i in range(start, start + lines))


def long_prompts(target: Target, tokens: int, n: int) -> list[str]:
    """n prompts of about `tokens` tokens each, by the server's own count (usage.prompt_tokens of
    two calibration requests), each starting with a nonce of its own, so no prompt cache (of this
    run's other prompts, of an earlier turn) serves one."""
    async def prompt_tokens(text: str) -> int:
        async with client(target, 1) as api:
            reply = await api.chat.completions.create(model=target.model, max_tokens=1, temperature=0.0,
                                                      messages=[{"role": "user", "content": text}])
            return reply.usage.prompt_tokens

    import openai

    try:
        bare = asyncio.run(prompt_tokens(_header(1, n) + LONG_ASK))
        lines8 = asyncio.run(prompt_tokens(_header(1, n) + _records(1000, 8) + "\n" + LONG_ASK))
    except openai.OpenAIError as exc:
        raise EdgerunError(f"{target.base_url}: measuring a long prompt's length failed: {exc}") from exc
    per_line = max((lines8 - bare) / 8, 1.0)
    lines = max(int((tokens - bare) / per_line), 1)
    return [_header(k + 1, n) + _records(1000 * (k + 1), lines) + "\n" + LONG_ASK for k in range(n)]


def _header(k: int, n: int) -> str:
    return f"Document {secrets.token_hex(4)}, {k} of {n}.\n"


async def _long_run(target: Target, prompts: list[str], streams: int, longs: list[str], max_tokens: int) -> dict:
    short: list[Outcome] = []
    stop = asyncio.Event()

    async def stream(api, k: int) -> None:
        i = k
        while not stop.is_set():
            out = await stream_one(api, target, prompts[i % len(prompts)], max_tokens)
            short.append(out)
            i += streams

    async with client(target, streams + 1) as api:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(stream(api, k)) for k in range(streams)]
            # the long prompts start once each stream has had a whole reply (the gaps before them
            # are the baseline); this polls the clients' progress and times nothing
            while len(short) < streams and not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)
            window_start = time.perf_counter()
            long_out = [await stream_one(api, target, text, LONG_REPLY_TOKENS) for text in longs]
            window_end = time.perf_counter()
            stop.set()
    return {"window": (window_start, window_end), "short": short, "long": long_out}


def long_summary(short: list[Outcome], long_out: list[Outcome], window: tuple[float, float]) -> dict:
    """The long-prompt run's figures (pure): the short streams' TPOT over requests that ran
    while a long prompt was in flight, their gaps between chunks inside that window and before
    it, and the long requests' TTFT."""
    start, end = window
    overlap = [o for o in short if o.error is None and o.sent < end and o.done > start]
    inside, before = [], []
    for o in short:
        for a, b in zip(o.chunks, o.chunks[1:]):
            (inside if start <= b <= end else before if b < start else []).append(b - a)
    ok_long = [o for o in long_out if o.error is None]
    failed = [o for o in short + long_out if o.error is not None]
    return {"streams_tpot_ms": _ms([o.tpot for o in overlap if o.tpot is not None]),
            "streams_gap_ms": _ms(inside) | {"max": max(inside) * 1000 if inside else None},
            "streams_gap_before_ms": _ms(before) | {"max": max(before) * 1000 if before else None},
            "long_ttft_ms": [o.ttft * 1000 if o.ttft is not None else None for o in long_out],
            "long_prompt_tokens": [o.prompt_tokens for o in ok_long],
            "errors": len(failed), "first_error": failed[0].error if failed else None,
            "window_s": end - start}


def run_long(target: Target, prompts: list[str], streams: int, tokens: int, n: int, max_tokens: int) -> dict:
    """Long prompts among `streams` running short streams: long_summary's figures."""
    longs = long_prompts(target, tokens, n)
    got = asyncio.run(_long_run(target, prompts, streams, longs, max_tokens))
    return {"streams": streams, "long_tokens": tokens, "long_count": n} | long_summary(got["short"], got["long"], got["window"])
