"""The OpenAI-compatible server, on the default model, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_helpers import LiveServer, start_server

from inflight.config import EngineConfig

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_llm) -> LiveServer:  # default_llm: the GGUF is converted already
    live = start_server(EngineConfig(kv_cache_memory="256MiB", max_num_seqs=64))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_models_health_and_tokenize(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CAPITAL}).json()
    assert chat["count"] > tokens["count"]


def test_completion(client, model):
    out = client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=8, temperature=0)
    assert "Paris" in out.choices[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == 5
    assert out.id.startswith("cmpl-")


def test_chat(client, model):
    out = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0,
                                         max_tokens=32)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streaming_chat_with_usage_equals_the_whole_answer(client, model):
    whole = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0,
                                           max_tokens=32).choices[0].message.content
    stream = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0,
                                            max_tokens=32, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_n_samples(client, model):
    out = client.chat.completions.create(model=model, messages=CAPITAL, n=2, temperature=1.0,
                                         seed=3, max_tokens=12)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.content for c in out.choices)
    again = client.chat.completions.create(model=model, messages=CAPITAL, n=2, temperature=1.0,
                                           seed=3, max_tokens=12)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    streamed = client.completions.create(model=model, prompt="One, two,", n=2, max_tokens=5,
                                         temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0] == texts[1] and texts[0]


def test_stop_strings(client, model):
    prompt = "List the days of the week: Monday, Tuesday,"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                     temperature=0).choices[0].text
    assert "Thursday" in full
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                    stop=["Thursday"])
    assert cut.choices[0].text == full[:full.index("Thursday")]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                         temperature=0, stop="Thursday", stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(value)  # greedy: the top one
    chat = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)


def test_extension_fields_and_request_history(client, model):
    out = client.completions.create(
        model=model, prompt="Hi", max_tokens=6, temperature=0, user="team-a",
        extra_body={"ignore_eos": True, "min_tokens": 6, "top_k": 5, "min_p": 0.1,
                    "repetition_penalty": 1.1, "priority": 3, "deadline_ms": 60000,
                    "expected_output_tokens": 6, "cache_salt": "team-a"})
    assert out.usage.completion_tokens == 6
    info = out.model_extra["inflight"]["requests"][0]
    assert info["first_token_time"] is not None and info["num_preemptions"] == 0
    events = [e["event"] for e in info["history"]]
    assert events[0] == "queued" and "scheduled" in events and events[-1] == "finished"
    times = [e["time"] for e in info["history"]]
    assert times == sorted(times) and info["history"][-1]["detail"] == "length"
    chunks = list(client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=3,
                                                 stream=True))
    assert chunks[-1].model_extra["inflight"]["requests"][0]["history"][-1]["event"] == "finished"
    assert all((c.model_extra or {}).get("inflight") is None for c in chunks[:-1])


def test_prefix_cache_over_http(server, client, model):
    system = {"role": "system", "content": "You are a terse assistant. " * 40 + str(time.time())}

    def cached(salt: str | None = None) -> int:
        out = client.chat.completions.create(
            model=model, messages=[system, *CAPITAL], max_tokens=2,
            extra_body={} if salt is None else {"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    hits = server.metric("inflight:prefix_cache_hits_total")
    assert cached() == 0
    second = cached()
    assert second >= 200
    assert server.metric("inflight:prefix_cache_hits_total") - hits == second
    assert server.metric("inflight:prefix_cache_queries_total") > 0
    assert cached("other tenant") == 0
    assert server.wait_idle()  # idle: cached blocks are free blocks, the usage gauge says 0
    assert server.engine.load().num_cached_blocks > 0
    assert server.metric("inflight:kv_cache_usage_perc") == 0
    reset = httpx.post(f"{server.url}/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["forgotten_blocks"] > 0
    assert cached() == 0
    assert server.wait_idle()


def test_64_concurrent_streams_then_an_empty_pool(server, model):
    prompts = ["Tell me about cats.", "Name a color.", "What is 2+2?", "Say hello."]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    before = server.metric("inflight:request_success_total", finished_reason="length") \
        + server.metric("inflight:request_success_total", finished_reason="stop")

    async def whole(prompt: str) -> str:
        out = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=16)
        return out.choices[0].message.content

    async def streamed(prompt: str) -> str:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=16, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main() -> tuple[list[str], list[str]]:
        expected = [await whole(p) for p in prompts]
        got = await asyncio.gather(*(streamed(prompts[i % 4]) for i in range(64)))
        return expected, got

    expected, got = asyncio.run(main())
    assert got == [expected[i % 4] for i in range(64)]
    assert server.wait_idle()
    after = server.metric("inflight:request_success_total", finished_reason="length") \
        + server.metric("inflight:request_success_total", finished_reason="stop")
    assert after - before == 64 + 4
    assert server.metric("inflight:num_requests_running") == 0
    assert server.metric("inflight:time_to_first_token_seconds_count") >= 68
    assert server.metric("inflight:generation_tokens_total") > 0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(server, model, stream):
    aborted = server.metric("inflight:request_success_total", finished_reason="abort")
    body = {"model": model, "prompt": "Write a very long story about the sea.",
            "max_tokens": 2000, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=30) as http:
        if stream:
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    start = time.monotonic()
    assert server.wait_idle(timeout=2.0)
    assert time.monotonic() - start < 1.5
    assert server.metric("inflight:request_success_total", finished_reason="abort") == aborted + 1


BIG = 10**30
BAD_REQUESTS = [
    # (endpoint, body or raw bytes, expected status, param mentioned)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"\xff\xfe{}", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 7}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": BIG}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "seed": BIG}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 9}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": True}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": [[1, 2], [10**12]]}, 400, "prompt_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x" * 1_000_000}, 400, None),
    ("/v1/completions", {"prompt": "word " * 9000}, 400, None),
    ("/v1/completions", b'{"prompt": "bad \\ud800 escape"}', 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CAPITAL, "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CAPITAL, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CAPITAL, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": CAPITAL, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": CAPITAL, "stream": True, "temperature": -2}, 400,
     "temperature"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/nowhere", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS,
                         ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(server, client, model, path, body, status, param):
    if isinstance(body, bytes):
        response = httpx.post(f"{server.url}{path}", content=body,
                              headers={"Content-Type": "application/json"}, timeout=60)
    else:
        response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert param in (error["param"] or "") or param in error["message"], error
    # the server still answers correctly and holds no blocks
    assert server.wait_idle()
    out = client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=3, temperature=0)
    assert "Paris" in out.choices[0].text


def test_prompt_over_the_limit_names_limit_and_length(server):
    response = httpx.post(f"{server.url}/v1/completions",
                          json={"prompt": [1] * 9000, "max_tokens": 1})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "9000" in message and f"max_model_len={server.engine.model_info.max_model_len}" in message


def test_wrong_method(server):
    response = httpx.get(f"{server.url}/v1/completions")
    assert response.status_code == 405 and "error" in response.json()


def test_backpressure_answers_429_with_retry_after(default_llm):
    live = start_server(EngineConfig(kv_cache_memory="64MiB", max_num_seqs=1),
                        max_waiting_requests=2)
    try:
        body = {"prompt": "Count to one hundred:", "max_tokens": 40, "ignore_eos": True}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                tasks = []
                for _ in range(8):
                    tasks.append(asyncio.create_task(http.post(f"{live.url}/v1/completions",
                                                               json=body)))
                    await asyncio.sleep(0.05)
                return await asyncio.gather(*tasks)

        responses = asyncio.run(burst())
        statuses = [r.status_code for r in responses]
        assert 200 in statuses and 429 in statuses, statuses
        for r in responses:
            if r.status_code == 429:
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
            else:
                assert r.json()["usage"]["completion_tokens"] == 40
        assert live.wait_idle()
    finally:
        live.stop()


def test_per_tenant_waiting_limit_answers_429(default_llm):
    live = start_server(EngineConfig(kv_cache_memory="64MiB", max_num_seqs=1),
                        max_waiting_per_tenant=1)
    try:
        body = {"prompt": "Count to one hundred:", "max_tokens": 30, "ignore_eos": True}

        async def burst() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                flood = []
                for _ in range(5):
                    flood.append(asyncio.create_task(http.post(
                        f"{live.url}/v1/completions", json={**body, "user": "flood"})))
                    await asyncio.sleep(0.1)
                light = await http.post(f"{live.url}/v1/completions",
                                        json={**body, "user": "light"})
                return await asyncio.gather(*flood), light

        flood, light = asyncio.run(burst())
        statuses = [r.status_code for r in flood]
        assert 200 in statuses and 429 in statuses, statuses
        assert all(r.json()["error"]["code"] == "queue_full" for r in flood if r.status_code == 429)
        assert light.status_code == 200  # another tenant's queue is its own
        assert live.wait_idle()
    finally:
        live.stop()


def test_max_queue_wait_ends_a_request_with_an_error(default_llm):
    live = start_server(EngineConfig(kv_cache_memory="64MiB", max_num_seqs=1), max_queue_wait=0.3)
    try:
        long_body = {"prompt": "Count:", "max_tokens": 120, "ignore_eos": True}

        async def run() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                first = asyncio.create_task(http.post(f"{live.url}/v1/completions", json=long_body))
                await asyncio.sleep(0.2)
                waiting = asyncio.create_task(http.post(f"{live.url}/v1/completions",
                                                        json={"prompt": "Hi", "max_tokens": 2}))
                streaming = asyncio.create_task(http.post(
                    f"{live.url}/v1/completions",
                    json={"prompt": "Hi", "max_tokens": 2, "stream": True}))
                return await first, await waiting, await streaming

        first, waiting, streaming = asyncio.run(run())
        assert first.status_code == 200
        for r in (waiting, streaming):
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "queue_timeout"
        assert live.wait_idle()
    finally:
        live.stop()


def test_api_key(default_llm):
    live = start_server(EngineConfig(kv_cache_memory="64MiB"), api_key="sekrit")
    try:
        for path in ("/v1/models", "/tokenize", "/reset_prefix_cache"):
            r = httpx.get(f"{live.url}{path}") if path == "/v1/models" else \
                httpx.post(f"{live.url}{path}", json={"prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(f"{live.url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert httpx.get(f"{live.url}/metrics").status_code == 200
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="sekrit", max_retries=0)
        out = client.completions.create(model=client.models.list().data[0].id, prompt="Hi",
                                        max_tokens=2)
        assert out.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong",
                          max_retries=0).models.list()
    finally:
        live.stop()


def test_sse_wire_format(server, model):
    body = {"model": model, "prompt": "Hi", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][6:])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_streamed_chunks_encode_every_field_in_order():
    """Chunks are msgspec structs: every field in OpenAI's order, None written
    as null, pydantic parts (logprobs, usage) dumped in place, text as UTF-8."""
    from inflight.server import protocol as p

    usage = p.Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3,
                    prompt_tokens_details=p.PromptTokensDetails(cached_tokens=0))
    text = p.CompletionChunk(id="cmpl-1", created=7, model="m", choices=[
        p.CompletionStreamChoice(index=0, text=" é\n", logprobs=p.CompletionLogprobs(
            tokens=[" é"], token_logprobs=[-0.5], text_offset=[0], top_logprobs=[None]))])
    assert p.encode_chunk(text) == (
        'data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":'
        '[{"index":0,"text":" é\\n","logprobs":{"text_offset":[0],"token_logprobs":[-0.5],'
        '"tokens":[" é"],"top_logprobs":[null]},"finish_reason":null}],"usage":null,'
        '"inflight":null}\n\n').encode()
    role = p.ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[
        p.ChatStreamChoice(index=0, delta=p.ChatDelta(role="assistant", content=""))],
        usage=usage)
    assert p.encode_chunk(role) == (
        'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
        '"choices":[{"index":0,"delta":{"role":"assistant","content":"","tool_calls":null},'
        '"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":2,'
        '"completion_tokens":1,"total_tokens":3,"prompt_tokens_details":{"cached_tokens":0}},'
        '"inflight":null}\n\n').encode()


def test_sigterm_lets_in_flight_requests_finish(default_llm, tmp_path):
    import signal
    import subprocess
    import sys

    from server_helpers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "inflight", "serve", "--port", str(port),
                             "--kv-cache-memory", "64MiB", "--shutdown-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            time.sleep(0.2)
        body = {"prompt": "Count:", "max_tokens": 60, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 60
        # uvicorn re-raises SIGTERM once it has shut down gracefully
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Finished server process" in proc.stdout.read()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_best_of(server, client, model):
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, n=1,
                                    best_of=3, temperature=1.0, seed=5)
    assert len(out.choices) == 1 and out.usage.completion_tokens == 6
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"prompt": "Hi", "best_of": 3, "stream": True, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "best_of": 1, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    assert server.wait_idle()


def test_beam_search(server, client, model, default_llm):
    from inflight import BeamSearchParams

    prompt = "The capital of France is"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=6, n=2,
                                    extra_body={"use_beam_search": True, "beam_width": 4})
    ids = default_llm.get_tokenizer().encode(prompt)
    expected = default_llm.beam_search([{"prompt_token_ids": ids}],
                                       BeamSearchParams(beam_width=4, max_tokens=6))[0]
    assert [c.text for c in out.choices] == [s.text for s in expected.sequences[:2]]
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(len(s.tokens) - len(ids)
                                              for s in expected.sequences[:2])
    width_n = client.completions.create(model=model, prompt=prompt, max_tokens=6, n=4,
                                        extra_body={"use_beam_search": True})
    assert [c.text for c in width_n.choices] == [s.text for s in expected.sequences]
    for extra, param in [({"stream": True}, "stream"), ({"temperature": 0.8}, "temperature"),
                         ({"n": 3, "beam_width": 2}, "n"), ({"logprobs": 2}, "logprobs"),
                         ({"stop": ["."]}, "stop"), ({"beam_width": 0}, "beam_width"),
                         ({"length_penalty": "long"}, "length_penalty")]:
        r = httpx.post(f"{server.url}/v1/completions", json={
            "prompt": "Hi", "max_tokens": 2, "use_beam_search": True, **extra})
        assert r.status_code == 400 and param in (r.json()["error"]["param"] or ""), (extra,
                                                                                       r.text)
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"prompt": "Hi", "max_tokens": 2, "beam_width": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "beam_width"
    assert server.wait_idle()


# ---------------------------------------------------------- hardening (issue 10)
NESTED = [b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
          b'{"prompt": "hi", "stop": ' + b"[" * 200 + b"]" * 200 + b"}",
          b'{"messages": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}"]


@pytest.mark.parametrize("body", NESTED, ids=["list-5000", "list-200", "object-3000"])
def test_deeply_nested_json_is_a_400(server, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(f"{server.url}{path}", content=body,
                              headers={"Content-Type": "application/json"}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "nested" in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "The sea", "max_tokens": 10**12}, "max_tokens"),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 10**6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 10**12}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CAPITAL, "max_completion_tokens": 10**9},
     "max_completion_tokens"),
])
def test_max_tokens_beyond_the_context_is_a_400_naming_the_limit(server, path, body, param):
    limit = server.engine.model_info.max_model_len
    for stream in (False, True):
        response = httpx.post(f"{server.url}{path}", json={**body, "stream": stream}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and str(limit) in error["message"]
    assert server.wait_idle()


def test_max_tokens_that_fits_and_omitted_max_tokens_still_run(server, model):
    limit = server.engine.model_info.max_model_len
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "The sea"}).json()["count"]
    response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": "The sea", "max_tokens": limit - tokens, "stop": ["\n", "."]})
    assert response.status_code == 200, response.text
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "The sea"})  # 16 by default
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 16


def test_gauges_drop_within_a_second_of_an_abort_on_an_idle_engine(server, model):
    body = {"model": model, "prompt": "Write a very long story about the sea.",
            "max_tokens": 2000, "ignore_eos": True, "stream": True}
    assert server.wait_idle()
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert server.metric("inflight:num_requests_running") == 1
            assert server.metric("inflight:kv_cache_usage_perc") > 0
    start = time.monotonic()
    while time.monotonic() - start < 1.0:
        if (server.metric("inflight:num_requests_running") == 0
                and server.metric("inflight:kv_cache_usage_perc") == 0
                and server.metric("inflight:num_requests_waiting") == 0):
            break
        time.sleep(0.05)
    assert server.metric("inflight:num_requests_running") == 0
    assert server.metric("inflight:kv_cache_usage_perc") == 0
    assert server.metric("inflight:num_requests_waiting") == 0


FAULT_SEED = 666


@pytest.fixture
def faulty_detokenizer(monkeypatch):
    """Requests with seed FAULT_SEED break the detokenizer at their third token."""
    from inflight.engine.output import SequenceDetokenizer

    original_init, original_add = SequenceDetokenizer.__init__, SequenceDetokenizer.add_token

    def init(self, tokenizer, params, stream):
        original_init(self, tokenizer, params, stream)
        self.faulty = params.seed == FAULT_SEED

    def add_token(self, token_id, num_output_tokens):
        if self.faulty and num_output_tokens >= 3:
            raise RuntimeError("injected detokenizer fault")
        return original_add(self, token_id, num_output_tokens)

    monkeypatch.setattr(SequenceDetokenizer, "__init__", init)
    monkeypatch.setattr(SequenceDetokenizer, "add_token", add_token)


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_request_ends_with_an_error_and_the_engine_serves_on(
        server, client, model, faulty_detokenizer, stream):
    failed = server.metric("inflight:request_success_total", finished_reason="error")
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True,
            "temperature": 0.7, "seed": FAULT_SEED, "stop": ["zzz"], "stream": stream}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    if stream:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        assert "injected detokenizer fault" in events[-1]["error"]["message"]
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["type"] == "server_error" and "injected detokenizer fault" in error["message"]
    assert server.wait_idle()
    assert server.metric("inflight:request_success_total", finished_reason="error") == failed + 1
    assert httpx.get(f"{server.url}/health").status_code == 200
    out = client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=3, temperature=0)
    assert "Paris" in out.choices[0].text
