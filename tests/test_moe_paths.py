"""The mixture-of-experts layer's GPU paths: the stacked experts (grouped matrix
products, or every expert on every token where there is no grouped product)
give the per-expert rows' result, on the CPU in float32 and, where a GPU is
lent, on it in float32 and bf16; also where the experts' Linears were handed
to ops whose packed weight is the plain one (the GPU's TritonOps)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import inflight.model.moe as moe_module
from inflight.model.layers import pack_linear_weights
from inflight.model.moe import MoeConfig, SparseMoe, grouped_mm_supported
from inflight.ops.torch_ops import TorchOps


CASES = [pytest.param("cpu", torch.float32, id="cpu-float32")] + [
    pytest.param("cuda", dtype, id=f"cuda-{dtype}".replace("torch.", ""), marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])
    for dtype in (torch.float32, torch.bfloat16)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class PlainPackedOps(TorchOps):
    """Runs linear layers itself from their plain [N, K] weight."""

    packs_weights = True

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()

    def linear(self, x, packed, bias, out_features):
        return F.linear(x, packed, bias)


@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize("path", ["grouped", "every-expert"])
@pytest.mark.parametrize("packed", [False, True])
def test_stacked_experts_give_the_per_expert_rows_result(path, device, dtype, packed,
                                                         monkeypatch):
    torch.manual_seed(0)
    config = MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=16,
                       norm_topk_prob=True, shared_intermediate_size=16)
    moe = SparseMoe(32, config, dtype, TorchOps()).to(device)
    with torch.no_grad():
        for param in moe.parameters():
            param.uniform_(-0.3, 0.3)
    if packed:
        pack_linear_weights(moe, PlainPackedOps())
    x = torch.randn(40, 32, dtype=dtype, device=device)
    experts, weights = moe.route(x)
    expected = moe._forward_grouped_rows(x, experts, weights)
    if path == "every-expert":
        monkeypatch.setattr(moe_module, "grouped_mm_supported", lambda *args: False)
    elif not grouped_mm_supported(dtype, x.device, 32, 16):
        pytest.skip(f"torch has no grouped matrix product for {dtype} on this {device}")
    got = moe._forward_stacked(x, experts, weights)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    gate_up, down = moe._stacked
    # Each expert's Linear reads a view of the stacks: no second copy.
    read = (lambda linear: linear.packed) if packed else (lambda linear: linear.weight)
    assert read(moe.experts[3].gate_up_proj).data_ptr() == gate_up[3].data_ptr()
    assert read(moe.experts[5].down_proj).data_ptr() == down[5].data_ptr()


def test_grouped_product_needs_aligned_rows():
    assert not grouped_mm_supported(torch.bfloat16, torch.device("cpu"), 36, 16)
