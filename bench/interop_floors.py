"""The reference's own arithmetic spread, and llama.cpp's arithmetic applied to the reference.

A consumer that computes the same model in another valid float order is no further from the
reference than the reference is from itself under such orders. Formats that round activations at run
time (W8A8, W4A8, FP8_DYNAMIC) make that distance large: an input summed in another order lands on
the neighbouring code, and the flip travels through every later layer. The spread is measured, not
assumed: the reference is scored again with every Linear's product summed in two parts split at a
seeded column (a genuine reordering of the float32 sums) and every decoder layer's input moved by
about one unit in the last place at seeded entries (what another order of the norms, attention and
residual sums leaves), ``ORDERS`` (19) times, in the precision the consumer computes in (float32;
bfloat16 for vLLM; for bitsandbytes, bfloat16 quantized products with each NF4 block's absmax in
bfloat16, as its CPU path casts it).

llama.cpp multiplies every quantized weight with its input rounded to 8-bit blocks
(:mod:`llmopt.formats.llama_cpp_inputs`); :func:`round_like_llama_cpp` hooks that rounding into the
reference, each Linear by its own tensor's type in the GGUF file, so llama.cpp's distributions can
be compared with the model it actually computes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# reorderings measured per spread: a consumer exchangeable with them lands beyond all of them with
# probability 1 / (ORDERS + 1), so 19 makes "beyond them all" a rank test at the 5% level
ORDERS = 19
VARIES = "Linear sums split, hidden states' last bits"  # what each order changes (a spread of another kind is measured again)


def _cut(n: int, generator: torch.Generator) -> int:
    """A seeded split point for ``n`` inputs: a multiple of 8 in their middle half."""
    return 8 * int(torch.randint(n // 32, max(n // 32 + 1, 3 * n // 32), (1,), generator=generator))


def _split_linear(x: torch.Tensor, w: torch.Tensor, cut: int, parts_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T`` as two partial products split at input ``cut`` and added (each rounded to
    ``parts_dtype`` first when given, the sum then in it)."""
    first, second = F.linear(x[..., :cut], w[:, :cut]), F.linear(x[..., cut:], w[:, cut:])
    if parts_dtype is not None:
        first, second = first.to(parts_dtype), second.to(parts_dtype)
    return first + second


def _split_sums(model: torch.nn.Module, seed: int) -> list:
    """Forward hooks recomputing every Linear's output as two partial products summed (split at a
    seeded multiple of 8 in the middle half of its inputs): the same value in another float order."""
    generator = torch.Generator().manual_seed(seed)
    handles = []
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module.in_features < 16:
            continue

        def hook(m, args, _out, cut=_cut(module.in_features, generator)):
            x = args[0]
            y = _split_linear(x, m.weight.to(x.dtype), cut)  # in the input's precision (the float64 Hadamard too)
            return y if m.bias is None else y + m.bias

        handles.append(module.register_forward_hook(hook))
    return handles


def absmax_in_bf16(w: torch.Tensor, blocksize: int) -> torch.Tensor:
    """An NF4 weight (each block of ``blocksize`` values, row-major, is its codes times the block's
    largest |value|) with each block's absmax rounded to bfloat16, as bitsandbytes' CPU path casts it."""
    blocks = w.reshape(-1, blocksize)
    absmax = blocks.abs().amax(1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
    return (blocks / absmax * absmax.bfloat16().to(w.dtype)).reshape(w.shape)


def _bf16_products(model: torch.nn.Module, weights: dict[str, torch.Tensor], seed: int) -> list:
    """Forward hooks computing the named Linears' products as bitsandbytes' CPU kernel does — with
    ``weights`` (Linear → its weight, each NF4 block's absmax in bfloat16: :func:`absmax_in_bf16`),
    the input rounded to bfloat16, the output in bfloat16 (here two partial sums, split at a seeded
    column, each rounded to bfloat16 and added in it: a bfloat16 order) — the rest of the model left
    in float32."""
    generator = torch.Generator().manual_seed(seed)
    handles = []
    for name, module in model.named_modules():
        if name in weights and isinstance(module, torch.nn.Linear):
            def hook(m, args, _out, cut=_cut(module.in_features, generator), w=weights[name]):
                x = args[0].bfloat16().to(args[0].dtype)
                y = _split_linear(x, w.to(x.dtype), cut, torch.bfloat16).to(args[0].dtype)
                return y if m.bias is None else y + m.bias
            handles.append(module.register_forward_hook(hook))
    return handles


def _last_bits(model: torch.nn.Module, seed: int) -> list:
    """Pre-hooks moving two thirds of the entries of every decoder layer's input hidden state
    (seeded) by about one unit in the last place, up or down: what computing the norms, attention
    and residual sums in another order does to them."""
    generator = torch.Generator().manual_seed(10_000 + seed)

    def nudge(h: torch.Tensor) -> torch.Tensor:
        sign = torch.randint(-1, 2, h.shape, generator=generator).to(h.dtype)
        return h * (1 + sign * torch.finfo(h.dtype).eps)

    def hook(_m, args, kwargs):
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": nudge(kwargs["hidden_states"])}
        return (nudge(args[0]), *args[1:]), kwargs

    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]


LARGER_IS_WORSE = ("max_dlogp", "kld_mean")


def spread(reference: torch.nn.Module, score: Callable[[torch.nn.Module], object],
           distance: Callable[[object, object], dict], precision: str, quantized: dict[str, int] | None = None) -> dict:
    """The largest distance of the reference from itself over ``ORDERS`` float orders in
    ``precision`` ("float32"; "bfloat16": the whole model; "bf16-products": the ``quantized``
    Linears' products, by name with their NF4 block size): each of ``distance``'s figures at its worst (the largest |Δlogp| or KLD,
    the lowest agreement)."""
    base = score(reference)
    model = reference.to(torch.bfloat16) if precision == "bfloat16" else reference
    modules = dict(model.named_modules())
    bnb_weights = {name: absmax_in_bf16(modules[name].weight.detach(), block) for name, block in (quantized or {}).items()
                   if isinstance(modules.get(name), torch.nn.Linear)}
    worst: dict = {}
    for seed in range(ORDERS):
        handles = _split_sums(model, seed) + _last_bits(model, seed)
        if precision == "bf16-products":  # registered after the split sums, so their outputs are the ones kept
            handles += _bf16_products(model, bnb_weights, seed)
        try:
            got = distance(base, score(model))
        finally:
            for handle in handles:
                handle.remove()
        for key, value in got.items():
            if isinstance(value, (int, float)) and key not in ("positions", "greedy_of"):
                pick = max if key in LARGER_IS_WORSE else min
                worst[key] = value if key not in worst else pick(worst[key], value)
    return {**worst, "orders": ORDERS, "precision": precision, "varies": VARIES}


def kld_distance(tokens, bos: int | None) -> tuple[Callable, Callable]:
    """(score, distance) for :func:`spread` on llama.cpp's own token windows: log-probabilities of
    each window's second half, KL(first ‖ second) as :func:`llama_cpp_kld.compare_with` takes it."""
    import numpy as np
    from llama_cpp_kld import compare_with

    def score(model):
        rows = []
        for row in tokens:
            ids = torch.tensor(row, dtype=torch.long)[None].clone()
            if bos is not None:
                ids[0, 0] = bos
            with torch.inference_mode():
                rows.append(model(ids).logits[0].float()[tokens.shape[1] // 2:tokens.shape[1] - 1].log_softmax(-1).numpy())
        return np.stack(rows)

    def distance(base, got):
        return compare_with(lambda ids, i=iter(range(len(tokens))): torch.from_numpy(_padded(got[next(i)], tokens.shape[1])),
                            tokens, base, bos)

    return score, distance


def _padded(second_half, n_ctx: int):
    """Log-probabilities of a window's second half placed at their positions in an ``n_ctx`` window."""
    import numpy as np

    out = np.zeros((n_ctx, second_half.shape[1]), dtype=np.float32)
    out[n_ctx // 2:n_ctx - 1] = second_half
    return out


def gguf_types(gguf_path: Path) -> dict[str, str]:
    """GGUF tensor name → its ggml type name."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(gguf_path)).tensors}


def round_like_llama_cpp(model: torch.nn.Module, gguf_path: Path) -> int:
    """Hook llama.cpp's input rounding into every Linear of ``model`` (a dequantized checkpoint in
    its Hugging Face layout) by the type of its tensor in ``gguf_path``; returns how many were
    hooked. A tied head takes the embedding's type, as llama.cpp multiplies with ``token_embd``."""
    import gguf
    from gguf import GGUFReader

    from llmopt.formats.llama_cpp_inputs import input_rounding

    reader = GGUFReader(str(gguf_path))
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    types = gguf_types(gguf_path)
    hooked = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        key = names.get_name(f"{name}.weight", try_suffixes=(".weight",))
        if key not in types and name == "lm_head":
            key = "token_embd.weight"
        if key not in types:
            raise RuntimeError(f"{name}: no tensor {key} in {gguf_path.name}")
        rounding = input_rounding(types[key])
        if rounding is not None:
            module.register_forward_pre_hook(lambda _m, args, r=rounding: (r(args[0]), *args[1:]))
            hooked += 1
    return hooked
