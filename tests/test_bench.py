"""Benchmark machinery on tiny models: workloads, runs, the HF baseline, plots."""

from __future__ import annotations

import json
import statistics

import pytest

from inflight.bench.throughput import run_engine, run_hf_continuous, run_hf_generate
from inflight.workload.offline import BenchRequest, from_file, parse_length, synthetic
from inflight.cli import main
from inflight.config import EngineConfig
from inflight.engine.factory import build_llm_engine
from inflight.ops.cpu_ops import load_library


def test_synthetic_workloads_follow_their_recipes():
    mixed = synthetic("mixed", 400, seed=0, vocab_size=1000, max_model_len=8192,
                      special_ids=frozenset(range(10)))
    assert mixed == synthetic("mixed", 400, seed=0, vocab_size=1000, max_model_len=8192,
                              special_ids=frozenset(range(10)))
    assert all(16 <= len(r.prompt_token_ids) <= 256 for r in mixed)
    assert {r.max_tokens for r in mixed} == {16, 64, 256}
    assert all(min(r.prompt_token_ids) >= 10 for r in mixed)
    share = [r.max_tokens for r in mixed]
    assert 0.4 < share.count(16) / 400 < 0.6 and 0.1 < share.count(256) / 400 < 0.3

    sharegpt = synthetic("sharegpt-like", 2000, seed=1, vocab_size=1000, max_model_len=8192)
    assert 130 < statistics.mean(len(r.prompt_token_ids) for r in sharegpt) < 195
    assert 270 < statistics.mean(r.max_tokens for r in sharegpt) < 410
    clipped = synthetic("sharegpt-like", 200, seed=1, vocab_size=1000, max_model_len=512)
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 512 for r in clipped)

    uniform = synthetic("uniform", 5, seed=0, vocab_size=1000, max_model_len=512,
                        input_len=30, output_len=7)
    assert {(len(r.prompt_token_ids), r.max_tokens) for r in uniform} == {(30, 7)}
    ranged = synthetic("uniform", 300, seed=0, vocab_size=1000, max_model_len=4096,
                       input_len=parse_length("100-1024"), output_len=parse_length("100-1024"))
    for lengths in ([len(r.prompt_token_ids) for r in ranged], [r.max_tokens for r in ranged]):
        assert 100 <= min(lengths) < 200 and 924 < max(lengths) <= 1024
        assert 480 < statistics.mean(lengths) < 645
    assert parse_length("7") == 7
    for bad in ("0", "9-3", "a-b", "-5", ""):
        with pytest.raises(ValueError, match="LOW-HIGH"):
            parse_length(bad)
    with pytest.raises(ValueError, match="workload"):
        synthetic("bursty", 1, seed=0, vocab_size=10, max_model_len=10)


def test_workload_file(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"requests": [{"prompt_token_ids": [1, 2], "max_tokens": 3},
                                             {"prompt": "hi", "max_tokens": 1}]}))
    assert from_file(path) == [BenchRequest([1, 2], 3), BenchRequest(None, 1, "hi")]
    for bad in ({"requests": []}, {"requests": [{"prompt": "x"}]},
                {"requests": [{"prompt": "x", "prompt_token_ids": [1], "max_tokens": 1}]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            from_file(path)


@pytest.fixture(scope="module")
def tiny_requests():
    return synthetic("mixed", 12, seed=3, vocab_size=384, max_model_len=512)


def test_static_runs_pad_and_continuous_runs_refill(tiny_model, tiny_requests):
    results = {}
    for mode in ("continuous", "static"):
        engine = build_llm_engine(EngineConfig(str(tiny_model("llama-gqa")), scheduling=mode,
                                         max_num_seqs=4, kv_cache_memory="16MiB"))
        results[mode] = run_engine(engine, tiny_requests, label=mode, ignore_eos=True,
                                   profile=True, record_batches=True)
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    cont, static = results["continuous"], results["static"]
    expected = sum(r.max_tokens for r in tiny_requests)
    assert cont.output_tokens == static.output_tokens == expected
    assert static.padded_slot_steps > 0 and cont.padded_slot_steps == 0
    assert cont.steps < static.steps and cont.mean_occupancy > static.mean_occupancy
    assert len(cont.batches) == cont.steps and max(cont.occupancy) <= 4
    profile = cont.profile_ms_per_step
    assert profile["total"] > 0 and profile["linear layers"] > 0 and profile["attention"] > 0


def test_model_stub_runs_without_a_model(tiny_model, tiny_requests):
    engine = build_llm_engine(EngineConfig(str(tiny_model("llama-gqa")), max_num_seqs=8,
                                     kv_cache_memory="16MiB"), model_stub=True)
    result = run_engine(engine, tiny_requests, label="stub", ignore_eos=True, profile=True)
    assert result.output_tokens == sum(r.max_tokens for r in tiny_requests)
    assert result.profile_ms_per_step["linear layers"] == 0


def test_hf_generate_baseline(tiny_model):
    requests = [BenchRequest([5, 6, 7], 2), BenchRequest([8] * 10, 9), BenchRequest([9, 9], 5)]
    result = run_hf_generate(tiny_model("llama-gqa"), requests, batch_size=2, ignore_eos=True)
    assert result.output_tokens == 2 + 9 + 5 and result.steps == 9 + 5
    # the first batch runs 9 steps, its short member padded for 7; the second
    # batch has one request in two slots for 5 steps
    assert result.padded_slot_steps == 7 and result.idle_slot_steps == 7 + 5


def test_hf_continuous_baseline(tiny_model):
    """Hugging Face's own continuous batching, each request with its own length."""
    requests = [BenchRequest(list(range(5, 5 + n)), m) for n, m in [(5, 7), (20, 3), (9, 12)]]
    result = run_hf_continuous(tiny_model("llama-gqa"), requests, ignore_eos=True)
    assert result.output_tokens == 22 and result.prompt_tokens == 34
    assert result.label == "hf-continuous" and result.wall_seconds > 0


def test_cli_throughput_and_sweep(tiny_model, tmp_path, capsys):
    model = str(tiny_model("llama-gqa"))
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", model, "--num-requests", "6",
                 "--ignore-eos", "--scheduling", "continuous,static", "--max-num-seqs", "2,4",
                 "--kv-cache-memory", "16MiB", "--repeat", "2", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["results"]) == 4 and report["roofline"]["best_percent"] > 0
    # The roofline's FLOP/s: the faster of PyTorch's product and the C kernels' own.
    by_kernel = report["roofline"]["matmul_flops_by_kernel"]
    assert set(by_kernel) == ({"torch", "inflight"} if load_library() else {"torch"})
    assert report["roofline"]["matmul_flops"] == max(by_kernel.values())
    repeats = report["repeat"]["output_tokens_per_second"]  # each row: the fastest of its runs
    assert len(repeats) == 4 and all(len(runs) == 2 for runs in repeats.values())
    for r in report["results"]:
        runs = repeats[f"{r['label']} max_num_seqs={r['max_num_seqs']}"]
        assert r["output_tokens_per_second"] == max(runs)
    assert "continuous/static output tokens/s at max_num_seqs=4" in report["ratios"]
    assert "of roofline" in capsys.readouterr().out

    pytest.importorskip("matplotlib")
    assert main(["bench", "sweep", "--model", model, "--num-requests", "6", "--ignore-eos",
                 "--max-num-seqs", "2,4", "--timeline-requests", "6", "--timeline-seqs", "3",
                 "--kv-cache-memory", "16MiB", "--output-dir", str(tmp_path)]) == 0
    for name in ("throughput_vs_batch.png", "slot_occupancy_timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_per_dtype_and_weight_format(tiny_model, tmp_path):
    """Each (format, dtype) pair is a run of its own, labelled by both (the
    machinery alone: a no-op model)."""
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", str(tiny_model("llama-gqa")),
                 "--num-requests", "3", "--ignore-eos", "--kv-cache-memory", "16MiB",
                 "--quantization", "none,w8a8", "--dtype", "float32,bfloat16", "--model-stub",
                 "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    labels = {r["label"] for r in report["results"]}
    assert labels == {f"continuous/weights-{w}/dtype-{d}" for w in ("none", "w8a8")
                      for d in ("float32", "bfloat16")}
    # Each ratio compares runs that differ in one part only, per value of the others.
    assert set(report["ratios"]) == {
        "w8a8/none output tokens/s at max_num_seqs=128 (dtype-float32)",
        "w8a8/none output tokens/s at max_num_seqs=128 (dtype-bfloat16)",
        "bfloat16/float32 total tokens/s at max_num_seqs=128 (weights-none)",
        "bfloat16/float32 total tokens/s at max_num_seqs=128 (weights-w8a8)"}


def test_each_run_builds_its_engine_after_the_last_one_is_freed(tiny_model, monkeypatch):
    """On a GPU the KV cache takes what memory is free, so a run's engine must be
    gone before the next is built (a list of configurations failed on an H100)."""
    import weakref

    from inflight.bench import commands

    built: list[weakref.ref] = []

    def build(config, **kwargs):
        assert all(ref() is None for ref in built), "the previous run's engine is still alive"
        engine = build_llm_engine(config, **kwargs)
        built.append(weakref.ref(engine))
        return engine

    monkeypatch.setattr(commands, "build_llm_engine", build)
    model = str(tiny_model("llama-gqa"))
    assert main(["bench", "throughput", "--model", model, "--num-requests", "4", "--ignore-eos",
                 "--max-num-seqs", "2,3", "--kv-cache-memory", "16MiB"]) == 0
    assert len(built) == 2


def test_shared_prefix_and_multi_turn_workloads_hit_the_cache(tiny_model):
    shared = synthetic("shared-prefix", 6, seed=0, vocab_size=384, max_model_len=512,
                       prefix_len=100, output_len=4)
    assert len({tuple(r.prompt_token_ids[:100]) for r in shared}) == 1
    assert all(116 <= len(r.prompt_token_ids) <= 148 for r in shared)
    turns = synthetic("multi-turn", 6, seed=0, vocab_size=384, max_model_len=2048,
                      output_len=5, turns=3)
    assert [r.follows for r in turns] == [None, 0, 1, None, 3, 4]
    with pytest.raises(ValueError, match="multi-turn conversation reaches"):
        synthetic("multi-turn", 8, seed=0, vocab_size=384, max_model_len=300, turns=8)

    path = str(tiny_model("llama-gqa"))
    rates = {}
    for cache in (True, False):
        # A budget that admits one shared-prefix prompt per step: prompts admitted
        # in the same step cannot reuse each other's blocks, not computed yet.
        engine = build_llm_engine(EngineConfig(path, kv_cache_memory="16MiB", max_num_batched_tokens=160,
                                         enable_prefix_caching=cache))
        one = run_engine(engine, shared, label="shared", ignore_eos=True)
        conversation = run_engine(engine, turns, label="turns", ignore_eos=True)
        # Each follow-up turn is sent with the history: its prompt holds the earlier turns.
        assert conversation.prompt_tokens > sum(len(r.prompt_token_ids) for r in turns)
        assert conversation.output_tokens == 6 * 5 and one.mean_ttft_seconds > 0
        rates[cache] = (one.prefix_cache_hit_rate, conversation.prefix_cache_hit_rate)
    assert rates[False] == (None, None)
    shared_rate, turns_rate = rates[True]
    assert 0.5 < shared_rate < 1 and 0.3 < turns_rate < 1


def test_chat_workloads_for_speculative_decoding():
    from inflight.workload.offline import chat_workload

    grounded = chat_workload("grounded", 6, 0, 128)
    assert all(c[0]["content"].startswith("Repeat the following text") for c in grounded)
    agent = [c[0]["content"] for c in chat_workload("agent", 24, 0, 128)]
    assert len(set(agent)) == 8 and agent[:8] == agent[8:16] == agent[16:]
    chat = chat_workload("chat", 10, 0, 128)
    assert len({c[0]["content"] for c in chat}) > 3
    assert chat_workload("chat", 10, 0, 128) == chat
    with pytest.raises(ValueError, match="no chat workload"):
        chat_workload("poetry", 1, 0, 128)


def test_a_benchmarks_server_takes_its_files_with_it(tiny_model, tmp_path, monkeypatch):
    """``ServerProcess`` removes its data directory and its log when it ends
    (and the server its sockets' directory), and keeps the log when what ran
    against it failed."""
    import httpx

    from inflight.bench.server_process import ServerProcess

    def ours() -> list[str]:
        return sorted(p.name.rsplit("-", 1)[0] + p.suffix for p in tmp_path.iterdir()
                      if p.name.startswith("inflight"))

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # (read from TMPDIR again)
    config = EngineConfig(str(tiny_model("llama-gqa")), kv_cache_memory="16MiB")
    with ServerProcess(config) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert ours() == ["inflight", "inflight-serve-data", "inflight-serve.log"]
    assert ours() == []
    with pytest.raises(KeyError), ServerProcess(config):
        raise KeyError("the benchmark failed")
    assert ours() == ["inflight-serve.log"]
