"""A written GGUF file checked through transformers' own GGUF loader: token ids and logits
against the source checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmopt.formats.gguf_source import Source, source_model

DEFAULT_VERIFY_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers "
    "that changed physics; one of them introduced the equation E = mc^2."
)


# Architectures whose GGUF keys transformers' loader reads only in part (Gemma's attention scale,
# soft-capping and per-layer windows; the experts' widths): their tensors are checked with the
# source's config.json; llama.cpp reads the keys themselves.
SOURCE_CONFIG = {"gemma2", "gemma3_text", "qwen2_moe", "qwen3_moe"}
NOT_LOADABLE = {"mixtral": "transformers' GGUF loader has no mapping for llama-architecture files with experts (Mixtral); "
                           "llama.cpp runs them"}


def verify_with_transformers(gguf_path: Path, source: Source, text: str | None = None) -> dict:
    """Load the GGUF through transformers' GGUF loader; compare token ids and logits with the source.

    Returns the tokenizer agreement, max |Δlogit| (absolute and relative to the largest logit),
    mean KL(source ‖ gguf) over positions and top-1 agreement; ``limitation`` instead where
    transformers cannot load the architecture from GGUF.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = text or DEFAULT_VERIFY_TEXT
    gguf_path = Path(gguf_path)
    result: dict[str, Any] = {"text": text}
    model_type = source.config.get("model_type")
    if model_type in NOT_LOADABLE:
        result["limitation"] = NOT_LOADABLE[model_type]
        return result
    kwargs: dict[str, Any] = {}
    if model_type in SOURCE_CONFIG:
        from llmopt.formats.compressed import float_config

        kwargs["config"] = float_config(source.path)  # the GGUF's weights are dequantized on load
        result["config"] = "the source's config.json (transformers' GGUF loader does not read all of this architecture's keys)"
    src_tok = AutoTokenizer.from_pretrained(source.path)
    try:
        gg_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        gg_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
                                                        **kwargs).eval()
    except Exception as exc:  # any failure of the loader is a finding to report, not a crash
        result["error"] = f"transformers could not load the GGUF: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        return result
    src_ids = src_tok(text)["input_ids"]
    gg_ids = gg_tok(text)["input_ids"]
    result["tokens"] = len(src_ids)
    result["token_ids_match"] = src_ids == gg_ids
    result["chat_template_match"] = getattr(src_tok, "chat_template", None) == getattr(gg_tok, "chat_template", None)
    model = source_model(source)
    ids = torch.tensor([src_ids])
    with torch.inference_mode():
        a = model(input_ids=ids).logits[0].float()
        b = gg_model(input_ids=ids).logits[0].float()
    diff = (a - b).abs().max().item()
    logp_a, logp_b = a.log_softmax(-1), b.log_softmax(-1)
    kld = (logp_a.exp() * (logp_a - logp_b)).sum(-1).clamp(min=0)
    result.update({
        "max_abs_logit_diff": diff,
        "rel_logit_diff": diff / max(a.abs().max().item(), 1e-12),
        "kld_mean": kld.mean().item(),
        "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    })
    return result
