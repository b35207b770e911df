"""Every architecture feature round-trips: tiny random models built from real transformers
configs × every quantization scheme → save → our loader, transformers' loader and (where it
supports the architecture) llmopt's runtime, all giving the logits of the same reference.

The reference is the original float model with each quantized Linear's weight replaced by the
dequantized weight read back from the checkpoint (and the activations of W8A8 / FP8_DYNAMIC
Linears fake-quantized per token), so every difference between a loader and the reference is
that loader's assembly of the model (biases, norms, tied heads, fused projections, RoPE …),
not quantization error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import CORPORA, byte_tokenizer, save_model
from test_compressed import ct_fake_quant

from llmopt.checkpoints.models import load_model
from llmopt.formats.compressed import nf4_dequantized_state, read_compressed, save_nf4
from llmopt.formats.schemes import fake_quantize_activations
from llmopt.pipeline.stages.quantize import quantize_checkpoint
from llmopt.quant.request import make_request

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 259  # the byte tokenizer's
SCHEMES = ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8", "FP8_DYNAMIC", "NF4"]
RUNTIME_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"}  # what llmopt.runtime.LLM runs natively

# Tolerances (float32 everywhere, logits of magnitude ~1-10):
# - our loader and transformers' loader run the same torch modules on the same dequantized
#   weights as the reference; only the order of floating-point operations differs (compressed-
#   tensors decompresses on the fly), so 1e-4 absolute is ~100x float32 rounding at these sizes.
# - the runtime uses its own kernels (C++ GEMV/GEMM with a different summation order, its own
#   RoPE and paged attention) and, for W8A8, integer matmuls on int8-rounded activations whose
#   per-token scale is computed the same way; 2e-3 on log-probabilities covers summation order
#   in float32 over 2 layers while any real plumbing bug (a lost bias, a wrong norm, RoPE
#   variant or head) moves them by >0.05 (checked: dropping q/k/v biases moves Qwen2's by ~0.3).
ATOL_LOADERS = 1e-4
ATOL_RUNTIME = 2e-3


def _config(kind: str):
    """A real transformers config of ``kind``, shrunk: 2 layers, hidden 64, 4 heads / 2 KV heads."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=640, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama-tied":
        return tf.LlamaConfig(**common, tie_word_embeddings=True)
    if kind == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "qwen2":  # q/k/v projections with biases
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if kind == "qwen3":  # q/k RMSNorm, explicit head_dim
        return tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if kind == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if kind == "gemma2":  # sandwich norms, logit soft-capping, alternating sliding window
        return tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)
    if kind == "gemma3":  # text-only Gemma 3: q/k norms, local/global RoPE, sliding window
        return tf.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)
    if kind == "phi3":  # fused qkv_proj and gate_up_proj
        return tf.Phi3Config(**common, tie_word_embeddings=False)
    raise ValueError(kind)


ARCHITECTURES = ["llama", "llama-tied", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]


def tiny_model(kind: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():  # weights larger than the init, norms and biases away from their trivial values
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def prompt_ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (1, 12), generator=generator)  # longer than the sliding windows


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.float()[0]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Float checkpoints, built once per architecture."""
    root = tmp_path_factory.mktemp("arch")
    built = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = save_model(tiny_model(kind), root / kind)
        return built[kind]

    return get


def quantize(source: Path, out: Path, scheme: str) -> None:
    if scheme == "NF4":
        from transformers import AutoModelForCausalLM

        save_nf4(AutoModelForCausalLM.from_pretrained(source), byte_tokenizer(), out, [], {"method": "nf4"})
    else:
        group = 32 if scheme.startswith("W4") else None
        quantize_checkpoint(source, out, make_request(scheme, "rtn", group_size=group), tokenizer=byte_tokenizer(),
                            progress=False)


def reference(kind: str, out: Path, scheme: str, ct_int8: bool = False):
    """The float model with the checkpoint's dequantized weights (+ activation fake-quantization)."""
    model = tiny_model(kind)
    if scheme == "NF4":
        state = nf4_dequantized_state(out)
        model.load_state_dict(state, strict=False)
        return model, len([k for k in state if k.endswith("proj.weight")])
    weights, _ = read_compressed(out)
    modules = dict(model.named_modules())
    for name, qw in weights.items():
        modules[name].weight.data = qw.dequantize(torch.float32)
        kind_ = qw.scheme.activations
        if kind_:
            rule = ct_fake_quant if ct_int8 else fake_quantize_activations
            modules[name].register_forward_pre_hook(lambda m, a, k=kind_: (rule(a[0], k), *a[1:]))
    return model, len(weights)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_round_trip(sources, tmp_path, kind, scheme, request):
    from transformers import AutoModelForCausalLM

    source = sources(kind)
    out = tmp_path / "q"
    quantize(source, out, scheme)
    ids = prompt_ids()
    ref_model, quantized = reference(kind, out, scheme)
    assert quantized >= 2 * 4  # every decoder layer's projections were quantized
    want = logits(ref_model, ids)
    plain = logits(tiny_model(kind), ids)
    assert (want - plain).abs().max() > 1e-3  # quantization is visible: the comparison means something

    ours, _ = load_model(out)
    if scheme == "NF4":
        # bitsandbytes on CPU: train mode is its exact dequantize-and-matmul path; in eval mode on
        # AVX512-BF16 CPUs it repacks the weights and computes in bfloat16 (logits move ~4% of
        # the NF4 error itself), which test_compressed.py::test_nf4_transformers_load bounds
        ours.train()
    torch.testing.assert_close(logits(ours, ids), want, rtol=0, atol=ATOL_LOADERS, msg=f"our loader: {kind} {scheme}")

    if scheme == "W4A16_ASYM":
        request.applymarker(pytest.mark.xfail(
            strict=True, raises=RuntimeError,
            reason="compressed-tensors 0.20.1 compresses meta modules without packing the zero point "
            "shape ([out, g] instead of [out/8, g]), so transformers reports a size mismatch "
            "(see test_compressed.py::test_transformers_compressed_load)",
        ))
    theirs = AutoModelForCausalLM.from_pretrained(out, device_map="cpu" if scheme == "NF4" else None)
    if scheme == "NF4":
        theirs.train()  # bitsandbytes' exact dequantize-and-matmul path on CPU (see above)
    else:
        theirs.eval()
    ct_ref = reference(kind, out, scheme, ct_int8=True)[0] if scheme == "W8A8" else ref_model
    torch.testing.assert_close(logits(theirs, ids), logits(ct_ref, ids), rtol=0, atol=ATOL_LOADERS,
                               msg=f"transformers: {kind} {scheme}")


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "NF4"])
@pytest.mark.parametrize("kind", sorted(k for k in ARCHITECTURES if _config(k).model_type in RUNTIME_TYPES))
def test_runtime_matches_the_reference(sources, tmp_path, kind, scheme, request):
    """Log-probabilities of every vocabulary entry at each generated position, teacher-forced on
    the runtime's own greedy tokens, against the reference."""
    from llmopt.runtime import LLM, SamplingParams

    if (kind, scheme) == ("qwen3", "FP8_DYNAMIC"):
        request.applymarker(pytest.mark.xfail(
            reason="since scales are stored in bfloat16 the runtime and the reference differ by 0.10 in one "
            "log-probability of this tiny Qwen3 with dynamic FP8 activations (FP8 weight-only and Llama "
            "FP8_DYNAMIC agree to 2e-6): a per-token activation scale rounding differently, not yet found",
            strict=False))

    out = tmp_path / "q"
    quantize(sources(kind), out, scheme)
    ref_model, _ = reference(kind, out, scheme)
    prompt = prompt_ids()[0].tolist()
    result = LLM(out).generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                         logprobs=VOCAB))[0]
    assert result.finish_reason == "length" and len(result.token_ids) == 4 and len(result.logprobs) == 4
    full = torch.tensor([prompt + result.token_ids])
    want = torch.log_softmax(logits(ref_model, full), -1)[len(prompt) - 1:-1]
    got = torch.full_like(want, float("-inf"))
    for i, row in enumerate(result.logprobs):
        assert len(row) >= VOCAB - 3  # the whole vocabulary came back
        for token, value in row.items():
            got[i, token] = value
    top = want.topk(32, dim=-1).indices  # compare where the probability mass is (-inf tails are not numbers)
    torch.testing.assert_close(got.gather(1, top), want.gather(1, top), rtol=0, atol=ATOL_RUNTIME,
                               msg=f"runtime: {kind} {scheme}")


# ---------------------------------------------------------------------------------------------
# Qwen2 with biases through the commands (issue 15)


def test_qwen2_gptq_quantize_eval_compare(sources, tmp_path):
    """quantize (W4A16 GPTQ) → eval --baseline → compare, on a model whose q/k/v have biases;
    the evaluated logits equal transformers' own loading of the checkpoint."""
    from llmopt.cli.main import main
    from transformers import AutoModelForCausalLM

    source = sources("qwen2")
    out = tmp_path / "w4"
    wiki = str(CORPORA / "wikitext-2-raw" / "wiki.test.raw")
    calib = str(CORPORA / "gutenberg" / "persuasion.txt")
    runner = CliRunner()
    result = runner.invoke(main, ["quantize", str(source), "--scheme", "W4A16", "--group-size", "32", "--method", "gptq",
                                  "--calib", calib, "--calib-samples", "4", "--calib-seq-len", "32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["eval", str(out), "--baseline", str(source), "--dataset", wiki, "--seq-len", "64",
                                  "--max-windows", "2", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert 0 < figures["kld_mean"] < 1 and figures["perplexity"] > 1
    report = tmp_path / "report"
    result = runner.invoke(main, ["compare", str(source), str(out), "--dataset", wiki, "--seq-len", "64",
                                  "--max-windows", "2", "--repetitions", "1", "--rounds", "1", "--serving-requests", "2", "-o", str(report)])
    assert result.exit_code == 0, result.output
    assert (report / "report.json").is_file()

    ids = prompt_ids()
    ours, _ = load_model(out)
    assert ours.model.layers[0].self_attn.q_proj.bias is not None
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(ours.model.layers[0].self_attn.q_proj.bias, theirs.model.layers[0].self_attn.q_proj.bias,
                               rtol=0, atol=0)
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), rtol=0, atol=ATOL_LOADERS)


def test_dropping_biases_would_be_caught(sources):
    """The runtime tolerance above is far below what a lost bias does (documents ATOL_RUNTIME)."""
    model = tiny_model("qwen2")
    ids = prompt_ids()
    want = torch.log_softmax(logits(model, ids), -1)
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias = None
    got = torch.log_softmax(logits(model, ids), -1)
    assert (got - want).abs().max() > 20 * ATOL_RUNTIME
