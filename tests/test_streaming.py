"""Layer-streaming compression: lazy reader, sharded writer, and streamed output identical to the
in-memory path (quantize_model + save_compressed) tensor for tensor."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import save_model, tiny_llama
from llmopt.checkpoints.lazy import LazyCheckpoint, read_tensors
from llmopt.checkpoints.models import load_model
from llmopt.checkpoints.writer import ShardedWriter
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import save_compressed
from llmopt.pipeline.stages.quantize import quantize_checkpoint
from llmopt.quant.apply import quantize_model
from llmopt.quant.request import make_request

pytestmark = pytest.mark.usefixtures("one_thread")


def _calib() -> torch.Tensor:
    return torch.randint(0, 259, (4, 32), generator=torch.Generator().manual_seed(1))


def _in_memory(src, out, scheme, method, group):
    model, tok = load_model(src)
    calib = None if method == "rtn" else _calib()
    result = quantize_model(model, make_request(scheme, method, group_size=group), calib, progress=False)
    save_compressed(model, tok, out, result.weights, ["lm_head"], {})
    return tok


def _assert_same(a_dir, b_dir) -> None:
    a, b = read_tensors(a_dir), read_tensors(b_dir)
    assert len(a) == len(b) and sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key
    assert json.loads((a_dir / "config.json").read_text()) == json.loads((b_dir / "config.json").read_text())


@pytest.mark.parametrize("scheme, method, group", [
    ("W4A16", "rtn", 32), ("W4A16", "gptq", 32), ("W4A16_ASYM", "awq+gptq", 32), ("W8A8", "smoothquant+gptq", None),
])
def test_streamed_quantize_is_identical_to_in_memory(tmp_path, scheme, method, group):
    src = save_model(tiny_llama(seed=0, tie_word_embeddings=method != "rtn"), tmp_path / "src")
    tok = _in_memory(src, tmp_path / "a", scheme, method, group)
    calib = None if method == "rtn" else _calib()
    request = make_request(scheme, method, group_size=group)
    result = quantize_checkpoint(src, tmp_path / "b", request, calib, tokenizer=tok, progress=False).result
    assert len(result.weights) == 14  # 7 Linears × 2 layers, kept as schemes only
    assert all(qw.codes.numel() == 0 for qw in result.weights.values())
    _assert_same(tmp_path / "a", tmp_path / "b")


def test_streamed_quantize_keeps_bf16_and_shards(tmp_path):
    model = tiny_llama(seed=2, tie_word_embeddings=False).to(torch.bfloat16)
    src = save_model(model, tmp_path / "src")
    with LazyCheckpoint(src) as ckpt:
        assert ckpt.floating_dtype() == torch.bfloat16
        assert ckpt.dtype("lm_head.weight") == torch.bfloat16 and ckpt.shape("lm_head.weight") == (259, 64)
    _in_memory(src, tmp_path / "a", "W4A16", "gptq", 32)  # loads in float32, writes float32
    quantize_checkpoint(src, tmp_path / "b", make_request("W4A16", "gptq", group_size=32), _calib(), progress=False,
                        max_shard_bytes=20_000)
    a, b = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert sorted(a) == sorted(b)
    index = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and sorted(index["weight_map"]) == sorted(b)
    for key in a:
        if b[key].is_floating_point() and key.endswith("weight"):  # dense tensors stay as stored
            assert b[key].dtype == torch.bfloat16, key
            assert torch.equal(a[key].to(torch.bfloat16), b[key]), key
        else:  # codes and scales bit for bit
            assert torch.equal(a[key], b[key]), key
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"


def test_sharded_writer_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(10, 10, generator=gen).to(torch.bfloat16) for i in range(5)}
    writer = ShardedWriter(tmp_path, max_shard_bytes=450)
    for key, t in tensors.items():
        writer.add(key, t)
    with pytest.raises(ValueError):
        writer.add("t0", tensors["t0"])
    files = writer.close()
    assert len(files) == 3  # 200 bytes each, at most two per shard
    back = read_tensors(tmp_path)
    assert len(back) == 5 and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_memory_estimate_refuses_before_writing(tmp_path, monkeypatch):
    src = save_model(tiny_llama(seed=0), tmp_path / "src")
    monkeypatch.setattr("llmopt.checkpoints.estimate.available_bytes", lambda device="cpu": -10**12)
    with pytest.raises(LlmoptError, match="GiB is free") as err:
        quantize_checkpoint(src, tmp_path / "b", make_request("W4A16", "gptq", group_size=32), _calib(), progress=False)
    assert "calib-samples" in err.value.fix
    assert not (tmp_path / "b").exists()


def test_estimate_grows_with_layer_not_depth():
    from llmopt.checkpoints.estimate import estimate_memory

    base = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 32000, "num_hidden_layers": 32}
    deep = estimate_memory({**base, "num_hidden_layers": 64}, 2, hessian=True, n_samples=16, seq_len=512)
    shallow = estimate_memory(base, 2, hessian=True, n_samples=16, seq_len=512)
    assert deep.peak == shallow.peak
    assert shallow.hessians > 8 * 14336**2  # the down projection's Hessian alone
    for one_pass in (False, True):  # float targets: a float layer copy, float hidden states, drift accumulators
        plain = estimate_memory(base, 2, hessian=True, n_samples=16, seq_len=512, one_pass=one_pass)
        float_targets = estimate_memory(base, 2, hessian=True, n_samples=16, seq_len=512, one_pass=one_pass, reference=True)
        assert float_targets.layer > 1.9 * plain.layer - 4 * 14336 * 4096
        assert float_targets.stored == 2 * plain.stored
        assert float_targets.hessians - plain.hessians >= 8 * 14336**2
        assert float_targets.peak > plain.peak


@pytest.mark.parametrize("method, sparsity, pattern, profile", [
    ("magnitude", 0.5, None, None), ("wanda", None, "2:4", None), ("sparsegpt", 0.5, None, None), ("wanda", 0.5, None, "owl"),
])
def test_streamed_prune_is_identical_to_in_memory(tmp_path, method, sparsity, pattern, profile):
    from llmopt.pruning.apply import PruneSettings, prune_model
    from llmopt.pruning.streaming import prune_streaming

    src = save_model(tiny_llama(seed=3), tmp_path / "src")
    settings = PruneSettings(method, sparsity=sparsity, pattern=pattern, profile=profile)
    calib = None if method == "magnitude" else _calib()
    model, tok = load_model(src)
    expected = prune_model(model, settings, calib, show_progress=False)
    model.save_pretrained(tmp_path / "a")
    record = prune_streaming(src, tmp_path / "b", settings, calib, show_progress=False)
    assert record["sparsity"] == expected["sparsity"]
    assert record["parameters"] == expected["parameters"]
    _assert_same(tmp_path / "a", tmp_path / "b")


def test_inverse_factor_matches_the_textbook_formula():
    """The memory-lean factor equals (H + λI) shifted with a full identity, retries included."""
    from llmopt.quant.gptq import _inverse_hessian_factor

    def reference(h, damp):
        eye = torch.eye(h.shape[0], dtype=h.dtype)
        for attempt in range(6):
            k, info = torch.linalg.cholesky_ex(h.flip(0, 1) + damp * 10**attempt * h.diagonal().mean().item() * eye)
            if info.item() == 0:
                return torch.linalg.solve_triangular(k, eye, upper=False).flip(0, 1)

    gen = torch.Generator().manual_seed(0)
    for rows, damp in ((512, 0.01), (20, 1e-6)):  # full rank; rank-deficient (needs retries)
        x = torch.randn(rows, 96, generator=gen, dtype=torch.float64)
        h = 2 * x.T @ x / rows
        expected = reference(h, damp)
        assert torch.equal(_inverse_hessian_factor(h, damp), expected)
        work = h.clone()  # consumed: used as the workspace, the factor converted before the last copy
        factor = _inverse_hessian_factor(work, damp, consume=True, dtype=torch.float32)
        assert factor.dtype == torch.float32 and factor.stride() == expected.stride()
        assert torch.equal(factor, expected.float())


def test_symmetric_permutation_in_place_equals_indexing():
    from llmopt.quant.gptq import permute_symmetric_

    gen = torch.Generator().manual_seed(2)
    for n in (1, 7, 130):
        h = torch.randn(n, n, generator=gen, dtype=torch.float64)
        perm = torch.randperm(n, generator=gen)
        expected = h[perm][:, perm]
        permute_symmetric_(h, perm)
        assert h.shape == expected.shape and torch.equal(h, expected)


def test_in_place_factor_of_large_hessians_matches_the_torch_path(monkeypatch):
    """Large consumed Hessians are factored in place through LAPACK (one float64 matrix instead
    of two): the same factor within float64 rounding, dampening retries included."""
    import llmopt.quant.gptq as gptq

    gen = torch.Generator().manual_seed(1)
    for rows, damp in ((512, 0.01), (20, 1e-6), (96, 0.01)):  # full rank; rank-deficient (retries); odd size
        n = 97 if rows == 96 else 96
        x = torch.randn(rows, n, generator=gen, dtype=torch.float64)
        h = 2 * x.T @ x / rows
        expected = gptq._inverse_hessian_factor(h.clone(), damp, consume=True, dtype=torch.float32)
        monkeypatch.setattr(gptq, "IN_PLACE_FACTOR_MIN", 64)
        work = h.clone()
        factor = gptq._factor_in_place(work, damp, h.diagonal().mean().item(), torch.float32)
        via_entry = gptq._inverse_hessian_factor(h.clone(), damp, consume=True, dtype=torch.float32)
        monkeypatch.undo()
        assert factor is not None and factor.shape == expected.shape == (n, n) and factor.dtype == torch.float32
        assert torch.equal(via_entry, factor)
        assert torch.allclose(factor, expected, rtol=1e-4, atol=1e-6 * expected.abs().max().item())
        assert torch.equal(factor.tril(-1), torch.zeros_like(factor))  # upper triangular, as the torch path


def test_gptq_blocks_of_rows_and_owned_inputs_change_nothing(monkeypatch):
    """qparams over blocks of rows, and a Hessian / weight handed over (modified in place), give
    the codes of the plain call; batches summed into the Hessian in blocks of rows give the same
    sum; a taken accumulator is the Hessian, and is gone afterwards."""
    import llmopt.linear_stats as linear_stats
    import llmopt.quant.gptq as gptq
    from llmopt.linear_stats import LinearStats
    from llmopt.formats.schemes import get_scheme

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 128, generator=gen), torch.randn(300, 128, generator=gen)
    lin = torch.nn.Linear(128, 96, bias=False)
    with LinearStats({"lin": lin}, channel=False, stop_early=False, hessian_dtype=torch.bfloat16) as stats:
        for batch in x.split(100):
            lin(batch)
    h = stats.hessian("lin")
    with monkeypatch.context() as mp:
        mp.setattr(linear_stats, "ADD_BLOCK", 5 * 128)  # blocks of 5 rows
        with LinearStats({"lin": lin}, channel=False, stop_early=False, hessian_dtype=torch.bfloat16) as blocked:
            for batch in x.split(100):
                lin(batch)
    assert torch.equal(blocked.hessian("lin"), h)
    direct = sum(b.bfloat16().T.float() @ b.bfloat16().float() for b in x.split(100)) * (2 / 300)
    torch.testing.assert_close(h.float(), direct, rtol=1e-2, atol=1e-2)
    for scheme, act_order, clip in ((get_scheme("W4A16_ASYM", 32), True, True), (get_scheme("W8A16"), False, True),
                                    (get_scheme("W4A16", 32), False, False)):
        plain = gptq.gptq_quantize_weight(w, h, scheme, scheme.group_size, act_order=act_order, clip=clip)
        with monkeypatch.context() as mp:
            mp.setattr(gptq, "QPARAM_BLOCK", 7 * 128)  # blocks of 7 rows, the last one shorter
            blocked = gptq.gptq_quantize_weight(w.clone(), h.clone(), scheme, scheme.group_size, act_order=act_order,
                                                clip=clip, hessian_owned=True, weight_owned=True)
        assert blocked.codes.shape == plain.codes.shape == (96, 128)
        assert torch.equal(blocked.codes, plain.codes) and torch.equal(blocked.scale, plain.scale)
        assert (blocked.zero_point is None) == (plain.zero_point is None)
        assert plain.zero_point is None or torch.equal(blocked.zero_point, plain.zero_point)
    taken = stats.take_hessian("lin")
    assert torch.equal(taken, h)
    for read in (stats.hessian, stats.take_hessian):
        with pytest.raises(ValueError, match="no Hessian left"):
            read("lin")


def test_gptq_codes_do_not_depend_on_thread_count():
    import contextlib

    import llmopt.quant.gptq as gptq
    from llmopt.formats.schemes import get_scheme

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(192, 128, generator=gen), torch.randn(256, 128, generator=gen)
    h = (2 * x.T @ x / 256).double()
    scheme = get_scheme("W4A16", 32)
    one = gptq.gptq_quantize_weight(w, h, scheme, 32, act_order=True, clip=True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gptq, "column_loop_threads", lambda t, work=0: contextlib.nullcontext())
            two = gptq.gptq_quantize_weight(w, h, scheme, 32, act_order=True, clip=True)
    finally:
        torch.set_num_threads(before)
    assert one.codes.shape == two.codes.shape and torch.equal(one.codes, two.codes)
    assert torch.equal(one.scale, two.scale)
