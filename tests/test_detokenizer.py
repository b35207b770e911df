"""Incremental detokenization and prompt log-probabilities in the runtime: the text decoded as it
grows equals one whole decode (byte-level and SentencePiece-style tokenizers, split characters),
each step decodes a bounded window, stop strings match on the new text only, streamed deltas add
up to the final text, and prompt log-probabilities equal transformers' forward whatever the
chunking or the prefix cache."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import byte_tokenizer, save_model, tiny_llama
from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.detokenizer import IncrementalDetokenizer, held_back

pytestmark = pytest.mark.usefixtures("one_thread")
ENGINE = dict(max_num_seqs=4, max_model_len=256, block_size=8, num_kv_blocks=256, threads=1)


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every id list it decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **kwargs) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def _incremental(tokenizer, ids: list[int]) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[:i]) for i in range(1, len(ids) + 1)]
    deltas.append(detok.flush(ids))
    return detok.text, deltas


def _demo_tokenizer():
    from transformers import AutoTokenizer

    from llmopt.checkpoints.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("demo"))


@pytest.mark.parametrize("make", [byte_tokenizer, _demo_tokenizer], ids=["byte-level", "demo"])
def test_incremental_text_equals_a_whole_decode(make):
    tokenizer = make()
    rng = random.Random(0)
    texts = ["Héllo wörld: naïve café — 日本語のテキスト, emoji 🤖🎉 and code:\n    return x ** 2\n",
             "   leading spaces, tabs\tand\n\nnewlines  ", "ab" * 40]
    cases = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    cases += [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))] for _ in range(150)]
    for ids in cases:
        text, deltas = _incremental(tokenizer, ids)
        assert len(text) == len(tokenizer.decode(ids, skip_special_tokens=True))
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas[:-1]) or "\ufffd" in tokenizer.decode(ids)


def test_split_characters_wait_for_their_last_byte():
    tokenizer = byte_tokenizer()
    ids = tokenizer("a🤖b", add_special_tokens=False).input_ids
    assert len(ids) == 6  # one token per byte: the emoji is four
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[:i]) for i in range(1, len(ids) + 1)]
    assert deltas == ["a", "", "", "", "🤖", "b"]


def test_each_step_decodes_a_bounded_window(tmp_path):
    """O(1) work per token: the windows decoded do not grow with the output."""
    llm = LLM(save_model(tiny_llama(seed=1), tmp_path / "m"), **ENGINE)
    counting = CountingTokenizer(llm.engine.tokenizer)
    llm.engine.tokenizer = counting
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, stop=["never-generated-stop"], stream_text=True)
    deltas = [out.delta_text for out in llm.stream([5, 6, 7], params)]
    assert len(deltas) == 200
    # a window grows only over bytes that are not yet whole characters (random weights emit
    # some): bounded, not growing with the output, and linear work in all
    assert max(counting.lengths) <= 16 and sum(counting.lengths) <= 8 * 200
    counting.lengths.clear()
    whole = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))[0]
    assert "".join(deltas) == whole.text


def test_stop_strings_cut_the_text_and_never_stream_past_it(tmp_path):
    llm = LLM(save_model(tiny_llama(seed=2), tmp_path / "m"), **ENGINE)
    free = llm.generate([[9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))[0].text
    assert len(free) >= 60
    stop = free[40:43]  # a string the greedy output contains
    cut = free[:free.index(stop)]
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, stop=[stop, "\x00never"],
                                include_stop_str_in_output=include)
        outs = list(llm.stream([9, 10, 11], params))
        final = outs[-1]
        expected = cut + stop if include else cut
        assert final.finish_reason == "stop" and final.stop_reason == stop
        assert len(final.text) == len(expected) and final.text == expected
        assert "".join(o.delta_text for o in outs) == expected
        assert llm.generate([[9, 10, 11]], params)[0].text == expected


def test_held_back_is_the_longest_stop_prefix_at_the_end():
    assert held_back("hello wor", ["world", "xyz"]) == 3
    assert held_back("hello", ["lo!", "llo!!"]) == 3
    assert held_back("hello", ["abc"]) == 0
    assert held_back("", ["abc"]) == 0


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=7), dict(enable_prefix_caching=False)],
                         ids=["one-chunk", "chunked", "no-prefix-cache"])
def test_prompt_logprobs_match_transformers(tmp_path, engine):
    model = tiny_llama(seed=4)
    path = save_model(model, tmp_path / "m")
    llm = LLM(path, **{**ENGINE, **engine})
    torch.manual_seed(0)
    prompts = [torch.randint(3, 259, (n,)).tolist() for n in (1, 2, 15, 22)]
    prompts.append(prompts[3][:16] + [7, 8, 9])  # shares two cached blocks with the one before
    llm.generate(prompts[3:4], SamplingParams(max_tokens=1))  # fill the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate(prompts, params)
    assert len(outs) == len(prompts)
    for ids, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        for i in range(1, len(ids)):
            entry = out.prompt_logprobs[i]
            assert entry[ids[i]] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
            top = ref[i - 1].topk(3)
            assert set(top.indices.tolist()) <= set(entry)
            assert len(entry) in (3, 4)  # the top three and the prompt token itself
