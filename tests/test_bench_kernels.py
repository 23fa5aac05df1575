"""``inflight bench kernels`` on a tiny model's shapes: what each figure counts."""

from __future__ import annotations

import json

import pytest

from inflight.cli import main
from inflight.model.loader import read_model_config
from inflight.ops.cpu_ops import load_library

pytestmark = pytest.mark.skipif(load_library() is None, reason="needs the C kernels")


def test_each_figure_counts_the_bytes_and_flops_of_its_shape(tiny_model, tmp_path, capsys):
    model = tiny_model("llama-gqa")
    cfg = read_model_config(model)
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--model", str(model), "--rows", "1,3",
                 "--decode", "2x40", "--prompt", "1x20", "--block-size", "8", "--repeats", "1",
                 "--block-order", "random,in order",
                 "--num-threads", "2", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {(r["kernel"], r["shape"]): r for r in report["results"]}
    assert set(rows) == {("read", "1 GiB"), ("linear", "m=1"), ("linear", "m=3"),
                         ("decode attention", "2x40 random"), ("decode attention", "2x40 in order"),
                         ("prompt attention", "1x20")}
    assert report["threads"] == 2 and report["block_size"] == 8
    assert all(r["seconds"] > 0 for r in rows.values())

    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = [((heads + 2 * kv_heads) * d, h), (h, heads * d),
              (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    panel_bytes = sum(-(-n // 16) * 16 * k * 4 for n, k in shapes) * layers
    assert rows["linear", "m=1"]["bytes"] == rows["linear", "m=3"]["bytes"] == panel_bytes
    assert rows["linear", "m=3"]["flops"] == 3 * layers * sum(2 * n * k for n, k in shapes)
    for order in ("random", "in order"):
        decode = rows["decode attention", f"2x40 {order}"]
        assert decode["bytes"] == 2 * 2 * 40 * kv_heads * d * 4 * layers
        assert decode["flops"] == 4 * 2 * 40 * heads * d * layers
    prompt = rows["prompt attention", "1x20"]
    assert prompt["bytes"] == 0 and prompt["flops"] == 4 * (20 * 21 // 2) * heads * d * layers
    assert rows["read", "1 GiB"]["bytes"] == 1 << 30
    for r in rows.values():
        if r["bytes"]:
            assert r["gb_per_second"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
    assert "decode attention" in printed and "of read" in printed


def test_other_weight_formats_and_a_bf16_cache_count_their_own_bytes(tiny_model, tmp_path):
    model = tiny_model("llama-gqa")
    cfg = read_model_config(model)
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--model", str(model), "--rows", "2", "--decode", "2x40",
                 "--prompt", "", "--block-order", "random", "--repeats", "1",
                 "--weights", "float32,bf16,w8a8", "--kv-dtype", "float32,bfloat16",
                 "--logit-softcap", "0,50", "--output-json", str(out)]) == 0
    rows = {(r["kernel"], r["shape"]): r for r in json.loads(out.read_text())["results"]}
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = [((heads + 2 * kv_heads) * d, h), (h, heads * d),
              (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    padded = sum(-(-n // 16) * 16 * k for n, k in shapes) * layers  # k: multiples of 32 here
    scales = sum(-(-n // 16) * 16 * 4 for n, _ in shapes) * layers
    assert rows["linear", "m=2 float32"]["bytes"] == 4 * padded
    assert rows["linear", "m=2 bf16"]["bytes"] == 2 * padded
    assert rows["linear", "m=2 w8a8"]["bytes"] == padded + scales
    assert (rows["decode attention", "2x40 random"]["bytes"]
            == rows["decode attention", "2x40 random cap 50"]["bytes"]
            == 2 * rows["decode attention", "2x40 random bf16 cap 50"]["bytes"]
            == 2 * rows["decode attention", "2x40 random bf16"]["bytes"]
            == 2 * 2 * 40 * kv_heads * d * 4 * layers)


@pytest.mark.parametrize("option,value", [("--rows", "0"), ("--rows", "4,x"),
                                          ("--decode", "12by300"), ("--prompt", "0x512"),
                                          ("--block-size", "0"), ("--block-order", "sideways"),
                                          ("--block-order", ""), ("--weights", "fp8"),
                                          ("--kv-dtype", "float16"),
                                          ("--logit-softcap", "-1"),
                                          ("--logit-softcap", "inf,x")])
def test_bad_shapes_are_refused_by_name(tiny_model, option, value, capsys):
    code = main(["bench", "kernels", "--model", str(tiny_model("llama-gqa")), option, value])
    assert code == 2
    assert option in capsys.readouterr().err


def test_block_tables_lie_in_order_or_scattered_over_the_whole_cache():
    from inflight.bench.kernels import _block_tables

    in_order, n = _block_tables(3, 5, "in order", seed=3)
    assert n == 15 and in_order.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9],
                                             [10, 11, 12, 13, 14]]
    scattered, n = _block_tables(3, 5, "random", seed=3)
    assert n == 15 and sorted(scattered.ravel().tolist()) == list(range(15))
    assert scattered.tolist() != in_order.tolist()
