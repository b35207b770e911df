"""AWQ for llama.cpp: the scale search counts llama.cpp's int8 rounding of each matmul's inputs."""

from __future__ import annotations

import torch

from llmopt.formats.registry import FORMATS
from llmopt.pipeline.stages.quantize import QuantizeConfig
from llmopt.formats.llama_cpp_inputs import rounded_to_int8_blocks
from llmopt.quant.rounding_cost import activation_block, activation_rounding_error


def test_int8_blocks_round_as_llama_cpp_q8():
    """Each block of 32 keeps int8 codes of step max|x| / 127: its largest value is exact, every
    value within half a step, and a block of zeros stays zero."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[1, 32:] = 0
    r = rounded_to_int8_blocks(x, 32)
    assert r.shape == x.shape
    step = x.reshape(4, 2, 32).abs().amax(-1, keepdim=True) / 127
    assert ((r - x).reshape(4, 2, 32).abs() <= step / 2 + 1e-7).all()
    codes = r.reshape(4, 2, 32) / step.clamp(min=1e-30)
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 127 + 1e-4
    assert torch.equal(r[1, 32:], torch.zeros(32))


def test_scaling_a_large_channel_down_lowers_the_rounding_error():
    """One channel 40× the others widens its block's step; dividing it by 40 (its weights times
    40) lowers the simulated error, which equals the direct computation."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=g)
    x[:, 7] *= 40
    w = torch.randn(32, 256, generator=g) / 16
    direct = 2 * float(((rounded_to_int8_blocks(x, 32) - x) @ w.T).pow(2).sum(1).mean())
    assert abs(activation_rounding_error(w, x, 32) - direct) < 1e-6 * direct
    s = torch.ones(256)
    s[7] = 40.0
    assert activation_rounding_error(w, x, 32, s) < activation_rounding_error(w, x, 32) / 3
    assert activation_rounding_error(w, x[:, :250], 32) == 0.0  # no whole blocks: not a llama.cpp shape


def test_blocks_follow_the_gguf_type_and_only_llama_requests_count_them():
    """K-quant weights round their inputs per 256 (Q8_K), 32-blocks per 32; the option is on (and
    the statistics keep input rows) for a llama.cpp mixture or --for llama.cpp only; GPTQ alone
    gets the channel order (:mod:`llmopt.quant.channel_order`) there, uncalibrated RTN nothing."""
    assert activation_block(FORMATS["int4km"].scheme(32), 512, 32) == 256
    assert activation_block(FORMATS["int5m"].scheme(32), 576, 32) == 32
    mixture = QuantizeConfig(model="demo", output="x", scheme="Q5_K_M", method="awq+gptq").build_method()
    assert mixture.transform.llama_activations and mixture.transform.sample_every > 0
    plain = QuantizeConfig(model="demo", output="x", scheme="W4A16", method="awq+gptq").build_method()
    assert not plain.transform.llama_activations and plain.transform.sample_every == 0
    ordered = QuantizeConfig(model="demo", output="x", scheme="Q5_K_M", method="gptq").build_method()
    assert ordered.name == "order+gptq" and ordered.transform.sample_every > 0  # the channel order first
    assert QuantizeConfig(model="demo", output="x", scheme="W4A16", method="gptq").build_method().transform is None
    assert QuantizeConfig(model="demo", output="x", scheme="Q5_K_M", method="rtn").build_method().transform is None
