"""Attention sinks of the int4 KV cache: the entry table, every backend's decode attention reading
them and the key offsets (against the reference and a hand computation), and the engine writing
position 0's float K/V into them."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import save_model, tiny_llama
from llmopt.runtime import LLM
from llmopt.runtime.backends import AttentionMetadata
from llmopt.runtime.backends.cpu import CpuBackend
from llmopt.runtime.backends.reference import ReferenceBackend
from llmopt.runtime.backends.triton import TritonBackend
from llmopt.runtime.kernels import build, kv_quant
from llmopt.runtime.kv_sinks import SINK_TOKENS, SPARE_ENTRIES, SinkTable
from llmopt.runtime.sampling_params import SamplingParams
from test_runtime_backends import CPU, paged_cache


def test_sink_table_hands_out_least_recently_used_entries_never_ones_in_use():
    table = SinkTable(3)
    table.begin_step()
    a, b = table.claim((1,)), table.claim((2,))
    assert sorted([a, b]) == [0, 1] and table.lookup((1,)) == -1  # claimed, not yet written
    table.begin_step()
    assert (table.lookup((1,)), table.lookup((2,)), len(table)) == (a, b, 2)
    table.begin_step()
    assert table.lookup((2,)) == b  # (1,) is now the least recently used
    c = table.claim((3,))
    assert c not in (a, b)  # a free entry first
    d = table.claim((4,))
    assert d == a  # then the least recently used one not in use this step
    assert table.claim((5,)) == -1  # every entry is in use this step
    table.begin_step()
    assert (table.lookup((1,)), table.lookup((3,)), table.lookup((4,))) == (-1, c, a)
    assert table.claim((3,)) == c and table.lookup((3,)) == c  # a key keeps its entry, readable, when written again


def test_sink_table_forgets_a_failed_step():
    table = SinkTable(2)
    table.begin_step()
    first = table.claim((7,))
    table.discard_pending()
    table.begin_step()
    assert table.lookup((7,)) == -1 and len(table) == 0
    assert sorted([table.claim((8,)), table.claim((9,))]) == sorted([first, 1 - first])


@pytest.mark.parametrize("tokens,offsets", [(1, False), (3, False), (1, True)])
def test_decode_attention_of_every_backend_reads_the_sinks_and_key_offsets(tokens, offsets):
    rng = random.Random(random.getrandbits(64))
    lens = sorted(rng.randint(1, 60) for _ in range(6))
    q, cache, meta = paged_cache(lens, "int4", rng)
    rows = (cache.k[0].shape[0], meta.block_tables.shape[1] + 2, cache.head_dim)
    key_offsets = (torch.randn(rows) * 3).half() if offsets else None  # as the cache keeps them
    cache.offsets_of = lambda index: key_offsets
    entries = 5
    sink_k, sink_v = torch.randn(2, cache.k[0].shape[0], entries, tokens, cache.head_dim) * 3
    cache.sinks_of = lambda index: (sink_k, sink_v)
    chosen = torch.tensor([rng.choice([-1, *range(entries)]) for _ in lens])
    chosen[0] = 2  # at least one sequence reads sinks, one its codes
    chosen[-1] = -1
    meta.decode_sinks = chosen
    want = ReferenceBackend(CPU, torch.float32).decode_attention(q, meta, cache, 0, 0.2)
    plain = ReferenceBackend(CPU, torch.float32).decode_attention(
        q, AttentionMetadata(meta.slots, meta.num_decodes, meta.block_tables, meta.context_lens), cache, 0, 0.2)
    assert want.shape == plain.shape == (len(lens), q.shape[1] * q.shape[2])
    assert not torch.allclose(want[0], plain[0]) and torch.equal(want[-1], plain[-1])
    # the reference: sequence 0's dequantized context with positions 0 .. tokens - 1 replaced
    n, bs = lens[0], cache.block_size
    slots = (meta.block_tables[0, :, None] * bs + torch.arange(bs)).flatten()[:n]
    keys = kv_quant.dequantize(cache.k[0][:, slots], cache.k_scale[0][:, slots], torch.float32)
    values = kv_quant.dequantize(cache.v[0][:, slots], cache.v_scale[0][:, slots], torch.float32)
    keys[:, :tokens], values[:, :tokens] = sink_k[:, 2, :n], sink_v[:, 2, :n]
    if offsets:  # each block's offset added back to its keys, sinks included
        keys += key_offsets[:, torch.arange(n) // bs].float()
    group = q.shape[1] // keys.shape[0]
    probs = torch.softmax(0.2 * torch.einsum("hgd,htd->hgt", q[0].view(-1, group, q.shape[2]), keys), -1)
    manual = torch.einsum("hgt,htd->hgd", probs, values).reshape(-1)
    torch.testing.assert_close(want[0], manual, rtol=1e-4, atol=1e-5)
    others = [TritonBackend(CPU, torch.float32)] + ([CpuBackend(CPU, torch.float32)] if build.compiler_available() else [])
    for backend in others:
        got = backend.decode_attention(q, meta, cache, 0, 0.2)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{backend.name}, {tokens} sink tokens, offsets {offsets}")


def test_engine_writes_position_zero_in_float_and_reads_it_back(tmp_path):
    """The sink entry of a prompt holds its position-0 K/V as a float32 cache in the same basis
    stores them; a second prompt with the same first token reads that entry on a prefix-cache hit."""
    path = save_model(tiny_llama(seed=3), tmp_path / "m")
    int4 = LLM(str(path), kv_cache_dtype="int4", max_num_seqs=2, kernels="reference")
    float_cache = LLM(str(path), kv_cache_dtype="auto", max_num_seqs=2, kernels="reference")
    source, target = int4.engine.cache, float_cache.engine.cache
    target.rotation, target.key_scale, target.k_offsets = source.rotation, source.key_scale, source.k_offsets
    assert len(source.sinks) == 0  # calibration's own entries are dropped with the old basis
    prompt = [5, 17, 99, 3, 42, 8, 11, 60, 71, 2, 9, 14, 33, 21, 7, 1, 4, 6]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    for engine in (int4, float_cache):
        engine.generate([prompt], params)
    assert len(source.sinks) == 1
    entry = source.sinks.lookup(tuple(prompt[:SINK_TOKENS]))
    assert entry >= 0 and source.sinks.capacity == 2 + SPARE_ENTRIES
    slot = 0  # each engine's first sequence starts in block 0 (the free list hands blocks out in order)
    for layer in range(len(source.k)):
        for store, cache in ((source.sink_k[layer], target.k[layer]), (source.sink_v[layer], target.v[layer])):
            torch.testing.assert_close(store[:, entry, :SINK_TOKENS], cache[:, slot:slot + SINK_TOKENS], rtol=1e-5, atol=1e-6)
    reads = []
    forward = int4.engine.runner.model.forward
    int4.engine.runner.model.forward = lambda batch, cache: reads.append(batch.attn) or forward(batch, cache)
    int4.generate([prompt[:17] + [77]], params)  # the first block (16 tokens) is a prefix-cache hit
    first = reads[0]
    assert first.sink_writes is None and [c.sink for c in first.prefills] == [entry]
    assert all(m.decode_sinks is not None and m.decode_sinks.tolist() == [entry] for m in reads[1:])


def test_a_failed_forward_leaves_no_sink_entry_behind(tmp_path):
    path = save_model(tiny_llama(seed=4), tmp_path / "m")
    llm = LLM(str(path), kv_cache_dtype="int4", max_num_seqs=1, kernels="reference")
    runner, sinks = llm.engine.runner, llm.engine.cache.sinks

    def broken(batch, cache):
        raise RuntimeError("out of memory")

    runner.model.forward = broken
    outputs = llm.generate([[9, 8, 7, 6]], SamplingParams(max_tokens=2))  # the engine fails the request, not itself
    assert len(outputs) == 1 and outputs[0].token_ids == []
    sinks.begin_step()
    assert sinks.lookup((9,)) == -1 and len(sinks) == 0


def test_a_one_token_prompt_writes_its_sink(tmp_path):
    path = save_model(tiny_llama(seed=5), tmp_path / "m")
    llm = LLM(str(path), kv_cache_dtype="int4", max_num_seqs=1, kernels="reference")
    llm.generate([[42]], SamplingParams(max_tokens=3, temperature=0.0))
    sinks = llm.engine.cache.sinks
    sinks.begin_step()
    assert len(sinks) == 1 and sinks.lookup((42,)) >= 0
