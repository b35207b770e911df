"""The runtime's kernel backends (runtime/backends): the choice made once per engine, each
backend's attention and linears against the reference backend, and the whole engine on the
Triton backend (Triton's CPU interpreter, ``TRITON_INTERPRET=1`` from conftest) token for token
against the reference backend."""

from __future__ import annotations

import importlib
import random
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from conftest import byte_tokenizer, save_model, tiny_llama
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import save_compressed
from llmopt.formats.schemes import QuantizedWeight, compute_qparams, effective_group_size, get_scheme
from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.backends import AttentionMetadata, choose_backend
from llmopt.runtime.backends.cpu import CpuBackend
from llmopt.runtime.backends.reference import ReferenceBackend
from llmopt.runtime.backends.triton import TritonBackend
from llmopt.runtime.config import KERNEL_CHOICES
from llmopt.runtime.kernels import build, reference
from llmopt.runtime.kernels.triton_linear import PackedWeight
from llmopt.runtime.layers import DenseLinear, QuantLinear
from llmopt.runtime.kv_cache import KVCache

CPU = torch.device("cpu")
needs_cpp = pytest.mark.skipif(not build.compiler_available(), reason="no C++ compiler: no C++ backend")


# ---------------------------------------------------------------------------------------------
# The choice


def test_every_backend_file_is_a_kernels_choice():
    assert KERNEL_CHOICES[0] == "auto" and len(KERNEL_CHOICES) >= 4
    assert {"cpu", "reference", "triton"} <= set(KERNEL_CHOICES)
    for name in KERNEL_CHOICES[1:]:
        module = importlib.import_module(f"llmopt.runtime.backends.{name}")
        assert module.BACKEND.name == name


@needs_cpp
def test_auto_is_cpu_on_the_cpu_and_triton_on_cuda():
    assert type(choose_backend("auto", CPU, torch.float32)) is CpuBackend
    assert type(choose_backend("auto", torch.device("cuda"), torch.float16)) is TritonBackend  # built, nothing allocated
    assert type(choose_backend("reference", CPU, torch.float32)) is ReferenceBackend


def test_auto_without_cpp_kernels_is_the_reference_with_a_warning(monkeypatch):
    monkeypatch.setattr("llmopt.runtime.backends.cpu.available", lambda: False)
    with pytest.warns(RuntimeWarning, match="plain-torch reference"):
        assert type(choose_backend("auto", CPU, torch.float32)) is ReferenceBackend
    with pytest.raises(LlmoptError, match="C\\+\\+ CPU kernels are not available"):
        choose_backend("cpu", CPU, torch.float32)


def test_backends_that_cannot_run_are_refused(monkeypatch):
    with pytest.raises(LlmoptError, match="kernels must be one of"):
        choose_backend("gpu", CPU, torch.float32)
    with pytest.raises(LlmoptError, match="C\\+\\+ kernels run on the CPU"):
        choose_backend("cpu", torch.device("cuda"), torch.float16)
    assert type(choose_backend("triton", CPU, torch.float32)) is TritonBackend  # interpreting (conftest)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(LlmoptError, match="TRITON_INTERPRET=1"):
        choose_backend("triton", CPU, torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_device_without_cuda_is_one_clear_line(tmp_path):
    from llmopt.cli.main import main

    path = save_model(tiny_llama(seed=0), tmp_path / "tiny")
    with pytest.raises(LlmoptError, match="no CUDA device"):
        LLM(path, device="cuda")
    with pytest.raises(LlmoptError, match="device must be cpu, cuda or cuda:N"):
        LLM(path, device="tpu")
    result = CliRunner().invoke(main, ["generate", str(path), "hi", "--device", "cuda"])
    assert result.exit_code == 2 and "no CUDA GPU" in result.output and "Traceback" not in result.output


# ---------------------------------------------------------------------------------------------
# Kernels of each backend against the reference backend


def paged_cache(lens: list[int], kind: str, rng: random.Random):
    """A KV cache (one layer) holding random K/V of sequences ``lens`` in shuffled blocks, and
    the decode metadata of one new token per sequence (already written)."""
    heads, kv_heads, dim, bs = 6, 2, 32, 4
    arch = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=dim)
    width = -(-max(lens) // bs)
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    cache = KVCache(arch, num_blocks, bs, torch.float32, kind)
    cache.data.normal_() if kind == "auto" else cache.data.zero_()
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        used = -(-n // bs)
        tables[i, :used] = torch.tensor([free.pop() for _ in range(used)])
        slots = (tables[i, :used, None] * bs + torch.arange(bs)).flatten()[:n]
        k, v = torch.randn(2, n, kv_heads, dim)
        reference.write_kv(cache.k[0], cache.v[0], k, v, slots, cache.k_scale[0], cache.v_scale[0])
    meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), len(lens), tables, torch.tensor(lens))
    return torch.randn(len(lens), heads, dim), cache, meta


@pytest.mark.parametrize("kind", ["auto", "float16", "int8", "fp8", "int4", "int4_g16"])
def test_decode_attention_of_every_backend_matches_the_reference(kind):
    rng = random.Random(random.getrandbits(64))
    lens = sorted(rng.randint(1, 60) for _ in range(5))
    q, cache, meta = paged_cache(lens, kind, rng)
    want = ReferenceBackend(CPU, torch.float32).decode_attention(q, meta, cache, 0, 0.2)
    assert want.shape == (len(lens), q.shape[1] * q.shape[2])
    others = [TritonBackend(CPU, torch.float32)] + ([CpuBackend(CPU, torch.float32)] if build.compiler_available() else [])
    for backend in others:
        got = backend.decode_attention(q, AttentionMetadata(meta.slots, meta.num_decodes, meta.block_tables, meta.context_lens),
                                       cache, 0, 0.2)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{backend.name}")


@pytest.mark.parametrize("preset,group", [("W4A16", 32), ("W4A16_ASYM", 32), ("W8A16", None), ("W8A8", None), ("W4A8", 32), ("FP8", None)])
def test_quantized_linear_of_every_backend_matches_the_reference(preset, group):
    scheme = get_scheme(preset, group or 0)
    weight = torch.randn(40, 96) * 0.1
    scale, zp = compute_qparams(weight, scheme, group)
    qw = QuantizedWeight.from_weight(weight, scheme, group, scale, zp)
    bias = torch.randn(40)
    x = torch.randn(3, 96)

    def prepared(backend):
        lin = QuantLinear.from_quantized(qw, bias)
        backend.prepare_linear(lin)
        return lin

    want = prepared(ReferenceBackend(CPU, torch.float32))(x)
    triton_lin = prepared(TritonBackend(CPU, torch.float32))
    assert isinstance(triton_lin.packed, PackedWeight) and triton_lin.codes.numel() == 0
    others = [triton_lin] + ([prepared(CpuBackend(CPU, torch.float32))] if build.compiler_available() else [])
    for lin in others:
        got = lin(x)
        assert got.shape == want.shape == (3, 40)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    dense = DenseLinear.from_weight(weight, bias)
    TritonBackend(CPU, torch.float32).prepare_linear(dense)
    torch.testing.assert_close(dense(x), x @ weight.T + bias)


# ---------------------------------------------------------------------------------------------
# The whole engine on the Triton backend


def w4a16_checkpoint(path):
    model = tiny_llama(seed=5, tie_word_embeddings=False)
    scheme = get_scheme("W4A16", 32)
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            gs = effective_group_size(module.in_features, scheme.group_size)
            scale, zp = compute_qparams(module.weight.data, scheme, gs)
            weights[name] = QuantizedWeight.from_weight(module.weight.data, scheme, gs, scale, zp)
    save_compressed(model, byte_tokenizer(), path, weights, ["lm_head"])
    return path


def assert_same_greedy(ours, theirs, what: str) -> None:
    """Token-for-token equal; only a near tie of the reference may flip (then the rest differs)."""
    assert len(ours.token_ids) == len(theirs.token_ids)
    for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)):
        if a != b:
            top = sorted(theirs.logprobs[i].values(), reverse=True)
            assert top[0] - top[1] < 1e-4, f"{what}: token {i}: triton {a}, reference {b}"
            return


@pytest.mark.parametrize("model,kv", [("float", "auto"), ("float", "int8"), ("float", "int4"), ("W4A16", "auto")])
def test_engine_on_triton_equals_the_reference_backend(tmp_path, model, kv):
    path = w4a16_checkpoint(tmp_path / "w4") if model == "W4A16" else save_model(tiny_llama(seed=4), tmp_path / "float")
    rng = random.Random(random.getrandbits(64))
    shared = [1] + [rng.randrange(3, 259) for _ in range(9)]  # a shared prefix: prefix-cache hits, chunks over cached context
    prompts = [shared + [rng.randrange(3, 259) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    settings = {"block_size": 4, "max_num_batched_tokens": 16, "kv_cache_dtype": kv}
    outs = {}
    for kernels in ("triton", "reference"):
        llm = LLM(path, kernels=kernels, **settings)
        assert llm.engine.backend.name == kernels
        if model == "W4A16":
            qkv = llm.engine.weights.layers[0].qkv
            assert isinstance(qkv, QuantLinear) and isinstance(qkv.packed, PackedWeight) == (kernels == "triton")
        outs[kernels] = llm.generate(prompts, params)
        assert llm.metrics()["prefix_cache_hit_tokens"] > 0
    assert [len(o.token_ids) for o in outs["triton"]] == [10] * len(prompts)
    for ours, theirs in zip(outs["triton"], outs["reference"]):
        assert_same_greedy(ours, theirs, f"{model} kv={kv}")
