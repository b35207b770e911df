"""The basis of an int4 KV cache, calibrated on a short text: per layer and KV head, the key
scale (keys multiplied, queries divided) and the key offsets of each block of positions,
removed from every key before it is quantized and added back as attention reads it (see
``KVCache``)."""

from __future__ import annotations

import torch
from llmopt.core.data import DEFAULT_CALIB, load_text

from .block_manager import BlockManager
from .model_runner import ModelRunner
from .sampling_params import SamplingParams
from .sequence import Sequence

CALIBRATION_TOKENS = 512
SKIP_CHARS = 20_000  # past a book's front matter


def basis_calibration_ids(tokenizer, count: int) -> list[int]:
    """``count`` tokens (fewer if the text is shorter) of the default calibration corpus."""
    text = load_text(DEFAULT_CALIB).documents[0]
    text = text[SKIP_CHARS:SKIP_CHARS + 12 * count] if len(text) > SKIP_CHARS + 12 * count else text
    return tokenizer.encode(text, add_special_tokens=False)[:count]


def layer_rope_tables(runner: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the cos and signed sin rows its keys are turned by: the runner's RoPE, or the
    layer's own where the model has one (``layer_rope``, Gemma 3's sliding layers)."""
    own = getattr(runner.model, "layer_rope", None)
    tables = []
    for index in range(runner.arch.num_layers):
        rope = (own(index) if own is not None else None) or runner.rope
        tables.append((rope.cos, rope.sin))
    return tables


@torch.inference_mode()
def calibrate_cache_basis(runner: ModelRunner, tokenizer, num_blocks: int, block_size: int, chunk: int, max_len: int,
                          offsets: bool = True) -> int:
    """Run the calibration text through the model (prompt chunks of ``chunk`` tokens, its own
    block table over the cache, nothing kept) and set the cache's key scales, and its key offsets
    unless ``offsets`` is False, from the queries and keys it saw. Returns the number of tokens used."""
    count = min(CALIBRATION_TOKENS, max_len, num_blocks * block_size)
    ids = basis_calibration_ids(tokenizer, count)
    seq = Sequence("kv-basis-calibration", ids, SamplingParams())
    blocks = BlockManager(num_blocks, block_size, False)
    blocks.allocate(seq, len(ids))
    cache = runner.cache
    cache.begin_basis_calibration(layer_rope_tables(runner))
    try:
        while seq.num_computed < len(ids):
            n = min(chunk, len(ids) - seq.num_computed)
            batch, _ = runner.prepare([(seq, n)])
            runner.model.forward(batch, cache)
            seq.num_computed += n
    finally:
        cache.end_basis_calibration(offsets)
    return len(ids)
