"""`edgerun serve` as a client sees it: the real server on a free 127.0.0.1 port, the tiny model
the session writes, driven with the official `openai` client and raw HTTP (httpx)."""

import asyncio
import json
import signal

import httpx
import openai
import psutil
import pytest
from openai import OpenAI

from testkit import serve
from testkit.cli import run_cli

PARALLEL = 16  # 16 clients at once decode in one batch
# how long a signal lets a running reply finish: a bound, not a speed (a busy machine is slow)
DRAIN = ("--drain-timeout", "120")


@pytest.fixture(scope="module")
def server(tiny_model):
    """The module's server; the last test of the file stops it with a signal."""
    # one thread: the tiny model's steps take a fraction of a millisecond, and two threads meeting at
    # llama.cpp's barriers on two busy cores wait a scheduler turn at each (a 24-token reply: 5 s)
    with serve.running(tiny_model, "--parallel", str(PARALLEL), "--ctx", "1024", "--threads", "1", *DRAIN) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return serve.client(server.url)


def model_name(client: OpenAI) -> str:
    return client.models.list().data[0].id


def chat(client, content="hello there", **kw):
    return client.chat.completions.create(model=model_name(client), messages=[{"role": "user", "content": content}],
                                          **{"temperature": 0, "max_tokens": 24} | kw)


def test_health_and_models(server, client, tiny_model):
    assert httpx.get(server.root + "/health", verify=serve.TLS).json()["status"] == "ok"
    names = [m.id for m in client.models.list().data]
    assert names == [str(tiny_model)]


def test_stream_deltas_concatenate_to_the_whole_reply(client):
    whole = chat(client)
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.choices[0].message.content
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_usage_counts_the_prompt_the_template_makes(client, server, tiny_model):
    from edgerun.runner import chat_tokens
    from edgerun.runtime.engine import Model

    reply = chat(client, "count me", max_tokens=5)
    with Model(tiny_model, vocab_only=True) as model:
        prompt = chat_tokens(model, [{"role": "user", "content": "count me"}])
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens <= 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    if reply.choices[0].finish_reason == "length":
        assert reply.usage.completion_tokens == 5


def test_max_tokens_ends_in_length(client):
    for field in ("max_tokens", "max_completion_tokens"):
        reply = chat(client, "go on and on", **{"max_tokens": None, field: 3})
        assert reply.usage.completion_tokens <= 3


def test_a_stop_string_ends_the_reply_before_it(client):
    free = chat(client, "stop test", max_tokens=40).choices[0].message.content
    assert len(free) > 6
    stop = free[3:6]
    reply = chat(client, "stop test", max_tokens=40, stop=[stop, "\x00never"])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == free[: free.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, "stop test", max_tokens=40,
                                                                       stop=stop, stream=True) if c.choices)
    assert streamed == free[: free.index(stop)]


def test_the_same_seed_gives_the_same_reply(client):
    a = chat(client, "random words", temperature=1.0, seed=1234, max_tokens=20).choices[0].message.content
    b = chat(client, "random words", temperature=1.0, seed=1234, max_tokens=20).choices[0].message.content
    c = chat(client, "random words", temperature=1.0, seed=99, max_tokens=20).choices[0].message.content
    assert a == b and a != c


def test_text_completions(client):
    name = model_name(client)
    whole = client.completions.create(model=name, prompt="abc", max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=name, prompt="abc", max_tokens=10, temperature=0, stream=True))
    assert streamed == whole.choices[0].text


def test_text_parts_are_joined(client):
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    assert chat(client, parts).choices[0].message.content == chat(client, "hello there").choices[0].message.content


BAD = [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, None),  # no model
    (json.dumps({"model": "MODEL", "messages": []}).encode(), 400, None),
    (json.dumps({"model": "MODEL", "messages": [{"role": "robot", "content": "x"}]}).encode(), 400, None),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), 400, None),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "temperature": 9}).encode(), 400, None),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "top_p": 0}).encode(), 400, None),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), 400, None),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "seed": -1}).encode(), 400, None),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "n": 3}).encode(), 400, None),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 9}).encode(), 400, None),
    (json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model_not_found"),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "x " * 3000}]}).encode(), 400,
     "context_length_exceeded"),
]


@pytest.mark.parametrize("body,status,code", BAD, ids=range(len(BAD)))
def test_bad_requests_get_an_openai_shaped_error(server, client, body, status, code):
    body = body.replace(b"MODEL", model_name(client).encode())
    reply = httpx.post(server.url + "/chat/completions", content=body, timeout=60, verify=serve.TLS)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["message"] and "\n" not in error["message"] and error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code
    assert chat(client, max_tokens=2).choices  # and the server goes on


def test_the_openai_client_sees_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, temperature=7)
    assert "temperature" in str(caught.value)


def metric(server, name: str) -> float:
    for line in httpx.get(server.root + "/metrics", verify=serve.TLS).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_what_was_served(server, client):
    before = metric(server, "edgerun_generated_tokens_total")
    reply = chat(client, "metrics", max_tokens=6)
    assert metric(server, "edgerun_generated_tokens_total") - before == reply.usage.completion_tokens
    assert metric(server, "edgerun_requests_running") == 0
    assert metric(server, "edgerun_kv_cells") >= PARALLEL * 1024
    text = httpx.get(server.root + "/metrics", verify=serve.TLS).text
    assert "edgerun_time_to_first_token_seconds_bucket" in text and "edgerun_time_per_output_token_seconds_count" in text


# logits: a top-2 gap this small may round either way in another batch's kernels. The tiny model's
# two layers move a logit by far less than a real model's 24, whose KV rounds differently per batch
# shape and carries that into every later step (the 0.5B's logits move by up to about 0.3 between a
# context evaluated in one batch and token by token)
NEAR_TIE = 0.05
NEAR_TIE_REAL = 0.5


def alone_and_together(client, model_path, n: int, max_tokens: int, near_tie: float = NEAR_TIE,
                       min_same: float = 0.75, threads: int = 2) -> None:
    """n different prompts at T=0, each served alone, then all n at once (batched steps). Each
    reply is the one a single sequence decodes by itself (testkit.serve.greedy_steps), token for
    token, or parts from it only at a pick whose two best logits were within near_tie: llama.cpp's
    kernels for a batch of several rows sum in another order than for one row, and only a near tie
    can come out the other way. Anything else (a reply that read another's KV, a wrong position,
    a stale sampler) parts at a clear pick and fails."""
    name = model_name(client)
    asks = [[{"role": "user", "content": f"Write about topic {i} at length, please."}] for i in range(n)]

    async def together():
        aclient = serve.async_client(str(client.base_url))
        try:
            return await asyncio.gather(*[aclient.chat.completions.create(
                model=name, messages=m, max_tokens=max_tokens, temperature=0) for m in asks])
        finally:
            await aclient.close()

    alone = [client.chat.completions.create(model=name, messages=m, max_tokens=max_tokens, temperature=0)
             for m in asks]
    batched = asyncio.run(together())
    same = 0
    for m, a, b in zip(asks, alone, batched):
        assert b.choices[0].finish_reason in ("stop", "length") and b.usage.completion_tokens <= max_tokens
        steps = serve.greedy_steps(model_path, m, max_tokens, threads=threads)
        for how, reply in (("alone", a), ("batched", b)):
            gap = serve.explain_difference(steps, reply.choices[0].message.content)
            assert gap is None or gap < near_tie, (how, m, reply.choices[0].message.content[:40], steps[-1][0][:40])
        same += a.choices[0].message.content == b.choices[0].message.content
    assert same >= int(n * min_same)  # on the tiny model near ties are rare: most replies are identical


def test_sixteen_clients_at_once_get_the_replies_they_get_alone(client, tiny_model):
    alone_and_together(client, tiny_model, 16, 32, threads=1)


KEY = "sesame"


@pytest.fixture(scope="module")
def lone_server(tiny_model, tmp_path_factory):
    """A server of its own with an API key: the one a reply alone is compared on (the key changes
    no reply) and the key is checked on; the last test of the file stops it with a signal. A home
    of its own, as `edgerun run` gets in the test."""
    home = {"EDGERUN_HOME": str(tmp_path_factory.mktemp("lone") / "home")}
    with serve.running(tiny_model, "--api-key", KEY, "--ctx", "1024", "--threads", "1", *DRAIN, env=home) as s:
        yield s


def test_served_alone_the_reply_is_edgerun_runs(lone_server, tiny_model, edgerun_home, capsys):
    """Same prompt, same sampler settings and seed: the same tokens as `edgerun run`, greedy and
    sampled (each request alone on a server of its own, as a single reply decodes in the same
    loop). `edgerun run` is cli.main in this process: the same code as the command."""
    prompt = "Tell me a story about a fox"
    c = serve.client(lone_server.url, KEY)
    for temp, seed in ((0.0, None), (0.9, 4242), (1.3, 7)):
        sampling = ["--temp", str(temp)] + (["--seed", str(seed)] if seed is not None else [])
        run = run_cli(capsys, "run", prompt, "-m", tiny_model, "--ctx", "1024", "--threads", "1", "-n", "40",
                      "--no-kv-cache", *sampling)
        assert run.returncode == 0, run.stderr  # capsys translates no newline: a bare \r stays
        served = chat(c, prompt, temperature=temp, max_tokens=40, **({"seed": seed} if seed is not None else {}))
        assert served.choices[0].message.content == run.stdout.removesuffix("\n"), (temp, seed)


def test_the_next_turn_of_a_conversation_reuses_its_kv(server, client):
    name = model_name(client)
    turn = [{"role": "user", "content": "A first question about prompt caches."}]
    first = client.chat.completions.create(model=name, messages=turn, max_tokens=8, temperature=0)
    evaluated = metric(server, "edgerun_prompt_tokens_evaluated_total")
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And a second one."}]
    second = client.chat.completions.create(model=name, messages=turn, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert metric(server, "edgerun_prompt_tokens_evaluated_total") - evaluated == second.usage.prompt_tokens - cached


def test_a_full_queue_is_answered_503(tiny_model):
    """The engine thread is not started, so nothing leaves the queue: one request for the free
    slot and `queue_limit` waiting fill it, and the next is refused at once."""
    from starlette.testclient import TestClient

    from edgerun.runner import Runner
    from edgerun.serve.app import ServerState, create_app
    from edgerun.serve.scheduler import Job, Overloaded, Scheduler
    from edgerun.settings import EngineSettings, SamplerSettings

    with Runner(tiny_model, EngineSettings(n_ctx=256, n_threads=1)) as runner:
        state = ServerState(names=["tiny"])
        state.scheduler = Scheduler(runner, state.metrics, queue_limit=2, step_tokens=64)
        for _ in range(3):
            state.scheduler.submit(Job([1, 2, 3], SamplerSettings(), 4, [], sink=lambda _event: None))
        with pytest.raises(Overloaded):
            state.scheduler.submit(Job([1, 2, 3], SamplerSettings(), 4, [], sink=lambda _event: None))
        with TestClient(create_app(state)) as http:
            reply = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
            assert http.get("/health").json() == {"status": "ok", "running": 0, "queued": 3}
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        error = reply.json()["error"]
        assert error["code"] == "server_overloaded" and "queue is full" in error["message"] and "\n" not in error["message"]


def test_a_step_fills_the_waiting_prompts_within_its_budget(tiny_model):
    """The engine's steps driven one by one (its thread not started): prompts that wait together
    get their first tokens from one step, and a prompt longer than the budget fills a chunk per
    step while the running replies each get a token from every step."""
    from edgerun.runner import Runner
    from edgerun.serve.metrics import Metrics
    from edgerun.serve.scheduler import Job, Scheduler
    from edgerun.settings import EngineSettings, SamplerSettings

    with Runner(tiny_model, EngineSettings(n_ctx=512, n_threads=1, n_seq=4)) as runner:
        metrics = Metrics()
        sched = Scheduler(runner, metrics, queue_limit=4, step_tokens=40, prefill_share=1.0, solo=False)
        evaluated = lambda: metrics.registry.get_sample_value("edgerun_prompt_tokens_evaluated_total")

        def job(prompt: list[int]) -> Job:
            j = Job(prompt, SamplerSettings(temperature=0.0), 64, [], sink=lambda _event: None)
            sched.submit(j)
            return j

        short = [job(list(range(10 + 3 * i, 20 + 3 * i))) for i in range(3)]  # 10 tokens each
        sched._admit()
        sched._step()
        assert all(j.last is not None and len(j.tokens) == 1 for j in short)
        assert evaluated() == 30

        long = job(list(range(100, 190)))  # 90 tokens: 37 a step beside the three running replies
        sched._admit()
        for n in (1, 2):
            sched._step()
            assert long.last is None and len(runner.ctx.held(long.seq)) == 37 * n
            assert all(len(j.tokens) == 1 + n for j in short)
        sched._step()
        assert long.last is not None and len(runner.ctx.held(long.seq)) == 90 and evaluated() == 120
        assert all(len(j.tokens) == 4 for j in short)


def test_clients_that_hang_up_mid_stream_free_their_slots(server, client):
    """200 requests, most dropped after their first tokens: afterwards nothing runs, the KV held
    by running requests is back to zero, the server answers, and its memory stayed bounded. A
    dropped reply may run to 200 tokens, so the engine is still decoding it when its client goes;
    every fifth is read to its end, a short one (24 tokens) decoded beside them."""
    name = model_name(client)
    proc = psutil.Process(server.proc.pid)
    rss_before = proc.memory_info().rss

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": name, "messages": [{"role": "user", "content": f"drop {i}"}],
                "max_tokens": 200 if i % 5 else 24, "temperature": 0.8, "stream": True}
        async with http.stream("POST", server.url + "/chat/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data:") and i % 5:
                    return  # hang up after the first event

    async def main():
        async with httpx.AsyncClient(timeout=120, verify=serve.TLS) as http:
            for start in range(0, 200, 20):
                await asyncio.gather(*[one(http, i) for i in range(start, start + 20)])
    asyncio.run(main())
    for _ in range(100):  # the engine notices a hang-up at its next step
        if metric(server, "edgerun_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert metric(server, "edgerun_requests_running") == 0
    assert metric(server, "edgerun_kv_cells_running") == 0
    assert metric(server, "edgerun_kv_cells_used") <= PARALLEL * 1024
    assert chat(client, max_tokens=3).choices
    assert proc.memory_info().rss - rss_before < 200 << 20


def test_a_key_is_required_when_given(lone_server):
    s = lone_server
    assert httpx.get(s.root + "/health", verify=serve.TLS).status_code == 200  # a probe needs no key
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        reply = httpx.get(s.url + "/models", headers=headers, verify=serve.TLS)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        serve.client(s.url, "wrong").models.list()
    assert serve.client(s.url, KEY).models.list().data


def test_another_address_needs_a_key(tiny_model, capsys):
    proc = run_cli(capsys, "serve", "-m", tiny_model, "--host", "0.0.0.0")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--api-key" in proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_drains_the_running_reply_and_exits_0(request, sig):
    """Each of the module's servers ends here, after serving the file's other tests: these run last."""
    s = request.getfixturevalue("lone_server" if sig == signal.SIGINT else "server")
    c = serve.client(s.url, KEY, timeout=60)
    stream = c.chat.completions.create(model=model_name(c), messages=[{"role": "user", "content": "go"}],
                                       max_tokens=60, temperature=0, stream=True)
    first = next(iter(stream))
    s.proc.send_signal(sig)
    rest = [chunk for chunk in stream]
    assert first and rest[-1].choices[0].finish_reason in ("stop", "length")  # drained, not cut
    assert s.proc.wait(60) == 0


def test_sixteen_clients_at_once_with_the_small_model(small_model):
    with serve.running(small_model, "--parallel", "16", "--ctx", "512", "--threads", "2") as s:
        c = serve.client(s.url, timeout=300)
        # the 0.5B parts at a near tie in about half of 16 replies of 32 tokens: each parting is checked
        alone_and_together(c, small_model, 16, 32, NEAR_TIE_REAL, min_same=0.0)
