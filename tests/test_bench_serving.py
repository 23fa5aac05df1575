"""The serving benchmark's workloads and what it reads from the server."""

from __future__ import annotations

from dataclasses import replace

import pytest
from server_helpers import start_server

from inflight.bench import serving
from inflight.workload import arrivals
from inflight.config import EngineConfig


def test_multi_tenant_requests_open_with_their_tenants_system_prompt():
    specs = arrivals.build_requests(arrivals.SCENARIOS["multi-tenant"], 120.0, seed=3)
    by_tenant: dict[str, list[str]] = {}
    for spec in specs:
        by_tenant.setdefault(spec.cls, []).append(spec.prompt)
        assert spec.max_tokens == 32 and spec.user == spec.cls
    assert len(by_tenant) == 8
    systems = set()
    for prompts in by_tenant.values():
        words = [p.split() for p in prompts]
        system = words[0][:1024]
        assert all(w[:1024] == system and 16 <= len(w) - 1024 <= 48 for w in words)
        systems.add(" ".join(system))
    assert len(systems) == 8  # each tenant its own
    # The same seed gives the same prompts; a tenant's system prompt does not
    # depend on the other classes.
    again = arrivals.build_requests(arrivals.SCENARIOS["multi-tenant"][3:4], 120.0, seed=3)
    assert again[0].prompt.split()[:1024] == by_tenant["tenant-3"][0].split()[:1024]
    assert [s.arrival for s in specs] == sorted(s.arrival for s in specs)


@pytest.mark.parametrize("caching", [True, False])
def test_the_prefix_hit_rate_comes_from_the_servers_counters(tiny_model, caching):
    server = start_server(EngineConfig(model=str(tiny_model("llama-gqa")), dtype="float32",
                                       kv_cache_memory="16MiB",
                                       enable_prefix_caching=caching))
    try:
        classes = [replace(c, rate=0.0, count=3, system_prompt_tokens=40, prompt_tokens=(4, 8),
                           output_tokens=(4, 4))
                   for c in arrivals.SCENARIOS["multi-tenant"][:2]]
        specs = arrivals.build_requests(classes, 1.0, seed=0)
        before = server.metric("inflight:prefix_cache_hits_total")
        data = serving.run(server.url, None, specs, concurrency=1, slo_ttft=None, slo_tpot=None)
        hits = server.metric("inflight:prefix_cache_hits_total") - before
        queries = server.metric("inflight:prefix_cache_queries_total")
        assert data["overall"]["failed"] == 0, data["overall"]["errors"]
        assert data["overall"]["requests"] == 6
        if caching:
            # Each tenant's later requests find its system prompt (one after another).
            assert hits > 0 and data["prefix_cache_hit_rate"] == pytest.approx(hits / queries)
            assert data["prefix_cache_hit_rate"] > 0.4
        else:
            assert data["prefix_cache_hit_rate"] in (None, 0.0)
    finally:
        server.stop()


def test_requests_go_out_at_their_arrival_times_and_lateness_is_reported(tiny_model):
    server = start_server(EngineConfig(model=str(tiny_model("llama-gqa")), dtype="float32",
                                       kv_cache_memory="16MiB"))
    try:
        specs = [arrivals.RequestSpec("c", arrival, "one two three", 2)
                 for arrival in (0.0, 0.3, 0.6, 0.9)]
        data = serving.run(server.url, None, specs, None, None, None)
        sent, late = data["sent_seconds"], data["overall"]["late_seconds"]
        assert data["overall"]["failed"] == 0 and len(sent) == 4
        # In the requests' order, none early, none very late on an idle machine.
        assert all(spec.arrival <= t < spec.arrival + 0.25 for spec, t in zip(specs, sent)), sent
        assert 0 <= late["p50"] <= late["p99"] < 0.25
        # A closed loop reports its send times in the requests' order too: two
        # at once, then each as a previous one finishes.
        data = serving.run(server.url, None, specs, 2, None, None)
        sent = data["sent_seconds"]
        assert len(sent) == 4 and max(sent[:2]) < 0.1 and min(sent[2:]) > 0
    finally:
        server.stop()


def test_a_stream_cut_anywhere_counts_each_event_once():
    """Events split across reads, several in one read, comments, CRLF line
    ends and an empty choice: the client counts the chunks that carry text,
    and the usage."""
    import asyncio
    import json

    import aiohttp
    from aiohttp import web

    from inflight.workload.arrivals import RequestSpec

    events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": ""}]},
              {"choices": [{"text": "bc"}]}, {"choices": [{"text": "d"}]},
              {"choices": [], "usage": {"completion_tokens": 4}}]
    body = (b": a comment\n\n" + b"".join(b"data: " + json.dumps(e).encode()
                                            + (b"\r\n\r\n" if i % 2 else b"\n\n")
                                            for i, e in enumerate(events))
            + b"data: [DONE]\n\n")
    cuts = [3, 9, 10, 40, 41, 42, 90, 150, len(body)]

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        start = 0
        for end in cuts:
            await response.write(body[start:end])
            start = end
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as http:
                return await serving.send(http, f"http://127.0.0.1:{port}", "m",
                                          RequestSpec("c", 0.0, "hi", 4))
        finally:
            await runner.cleanup()

    result = asyncio.run(main())
    assert result.ok and not result.error
    assert result.output_tokens == 4
    assert result.ttft is not None and len(result.chunk_gaps) == 2  # three chunks with text
