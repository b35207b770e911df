"""Any other transformers causal LM: transformers' own modeling code, with the runtime's paged KV
attention plugged in through transformers' attention interface and the runtime's linears
(float or quantized, through the backend's kernels) in place of its ``nn.Linear`` modules.

The engine's flattened batch runs as one row ``[1, tokens]`` with each token's position in
``position_ids``; the registered attention function (``llmopt_paged``) ignores transformers'
mask, writes K/V into the paged cache and attends through the backend with the same
:class:`AttentionMetadata` as the native models, so continuous batching, chunked prefill and
prefix caching work unchanged. Slower than a native model (transformers' Python per layer,
no fused steps) but correct. A model whose code does not route attention through the
interface, once per layer, with the shapes its config implies, is refused at load.
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from llmopt.core.errors import LlmoptError
from llmopt.checkpoints.moe import canonical_key, unfuse_experts
from llmopt.formats.schemes import dequantize
from torch import nn

from ..backends import Backend, ForwardBatch
from ..config import ModelArch
from ..kv_cache import KVCache
from ..layers import HALF_HEADS, DenseLinear, Linear, TransformedLinear, smaller_head
from ..loader import Reader, _quantized

ATTN_NAME = "llmopt_paged"
_state = threading.local()  # the forward in progress: its batch, cache and backend (or a probe)


@dataclass
class _Step:
    """One forward's inputs for the attention function; ``calls`` counts the layers seen."""

    batch: ForwardBatch | None
    cache: KVCache | None
    backend: Backend | None
    windows: dict[int, int | None] = field(default_factory=dict)
    calls: int = 0
    seen: list[tuple] = field(default_factory=list)  # probe: (heads, kv_heads, head_dim, unsupported kwargs) per call


@contextmanager
def _active(step: _Step):
    previous = getattr(_state, "step", None)
    _state.step = step
    try:
        yield step
    finally:
        _state.step = previous


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[1, heads, T, dim]``, ``key`` /
    ``value`` ``[1, kv_heads, T, dim]`` (RoPE applied); returns ``[1, T, heads, dim]``. Layers are
    numbered in call order (transformers runs them in sequence)."""
    step: _Step = _state.step
    index = step.calls
    step.calls += 1
    _, heads, tokens, dim = query.shape
    if step.cache is None:  # the load-time probe
        unsupported = sorted(k for k in ("s_aux", "sinks") if kwargs.get(k) is not None)
        step.seen.append((heads, key.shape[1], dim, tuple(unsupported)))
        return query.new_zeros(1, tokens, heads, dim), None
    cache, meta = step.cache, step.batch.attn
    q, k, v = cache.to_cache_basis(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), index)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cache.store(index, k, v, meta.slots, meta.sink_writes, meta.key_blocks)
    scale = scaling if scaling is not None else dim ** -0.5
    window = step.windows.get(sliding_window) if sliding_window else None
    if window is None and softcap is None:
        out = step.backend.attention(q, k, v, meta, cache, index, scale)
    else:
        out = step.backend.attention(q, k, v, meta, cache, index, scale, window=window, softcap=softcap)
    return out.view(1, tokens, heads, dim), None


def _no_mask(*args, **kwargs) -> None:
    """The paged attention masks by itself (causal, per sequence): transformers builds none."""
    return None


def register() -> None:
    """Register ``llmopt_paged`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)


class RuntimeLinear(nn.Module):
    """An ``nn.Linear`` stand-in running one of the runtime's linears (any leading shape)."""

    def __init__(self, lin: Linear, in_features: int) -> None:
        super().__init__()
        self.lin, self.in_features, self.out_features = lin, in_features, lin.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x.reshape(-1, x.shape[-1]).contiguous())
        return y.view(*x.shape[:-1], y.shape[-1])


@dataclass
class GenericWeights:
    """What the engine reads of a model's weights (the native models' ``ModelWeights`` subset)."""

    lm_head: Linear
    quantization: str | None
    head_kind: str
    module: nn.Module
    layers: list = field(default_factory=list)

    def nbytes(self) -> int:
        linears = [m.lin for m in self.module.modules() if isinstance(m, RuntimeLinear)]
        plain = sum(t.numel() * t.element_size() for t in list(self.module.parameters()) + list(self.module.buffers()))
        return plain + sum(lin.nbytes() for lin in linears)


def _linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``nn.Linear`` modules, and GPT-2 style ``Conv1D`` (weight ``[in, out]``), by name."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            found[name] = module
    return found


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


class GenericModel:
    """A transformers causal LM on the engine's paged KV cache and backend."""

    def __init__(self, arch: ModelArch, hf: nn.Module, backend: Backend, max_model_len: int) -> None:
        self.arch, self.hf, self.backend = arch, hf, backend
        self.max_model_len = max_model_len
        self.keep_rows = "logits_to_keep" in inspect.signature(hf.forward).parameters

    def _window(self, window: int) -> int | None:
        """A window no sequence can exceed changes nothing: None (the plain path) then."""
        return window if window < self.max_model_len else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Logits ``[len(batch.sample_rows), vocab]`` (float32)."""
        step = _Step(batch, cache, self.backend, _WindowMap(self._window))
        rows = batch.sample_rows
        kwargs = {}
        if self.keep_rows and rows is not None:
            kwargs["logits_to_keep"] = rows
        with _active(step):
            out = self.hf(input_ids=batch.input_ids[None], position_ids=batch.positions[None], use_cache=False, **kwargs)
        logits = out.logits[0]
        if not self.keep_rows and rows is not None and rows.numel() != logits.shape[0]:
            logits = logits.index_select(0, rows)
        return logits.float()

    def probe(self) -> list[tuple]:
        """One forward of a two-token input recording every attention call (no cache)."""
        step = _Step(None, None, None)
        ids = torch.ones(1, 2, dtype=torch.long, device=self.backend.device)
        with _active(step), torch.inference_mode():
            self.hf(input_ids=ids, position_ids=torch.arange(2, device=ids.device)[None], use_cache=False)
        return step.seen


class _WindowMap(dict):
    """``sliding_window`` as a module passes it -> the window the backend applies (memoised)."""

    def __init__(self, rule) -> None:
        super().__init__()
        self.rule = rule

    def __missing__(self, window: int) -> int | None:
        self[window] = value = self.rule(window)
        return value

    def get(self, window, default=None):  # noqa: D102 - dict.get skips __missing__
        return self[window]


def load_model(path: Path, arch: ModelArch, dtype: torch.dtype, backend: Backend, lm_head: str, max_model_len: int):
    """Build ``arch``'s transformers model, swap its linears for the runtime's, load the rest of
    the checkpoint into it and check it attends through the interface: ``(model, weights)``."""
    import json

    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    register()
    cfg = arch.hf_config
    config = json.loads((path / "config.json").read_text())
    quantized, dense, description = _quantized(path, config)
    r = Reader(path, quantized, dense, dtype, backend, config)
    with no_init_weights(), torch.device(backend.device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=ATTN_NAME)
    unfuse_experts(hf)  # fused 3-D experts (transformers v5) become one Linear per expert projection, as checkpoints store them
    hf.eval()
    state_names = set(hf.state_dict())
    names = _checkpoint_names(hf, list(dense) + [f"{m}.weight" for m in quantized], path)

    def stored(name: str) -> str | None:
        """The checkpoint's name for the model's tensor ``name``, or for module ``name``'s weight's module."""
        if name in names:
            return names[name]
        weight = names.get(f"{name}.weight")
        return weight.rpartition(".")[0] if weight is not None else None

    head_module = hf.get_output_embeddings()
    head_name = next((n for n, m in hf.named_modules() if m is head_module), None)
    replaced: dict[str, Linear] = {}
    for name, module in _linear_modules(hf).items():
        source = stored(name)
        if source is None:
            continue  # a tied head, handled below
        lin = r.linear(source)
        if type(module).__name__ == "Conv1D" and isinstance(lin, DenseLinear):
            lin = DenseLinear.from_weight(lin.weight.t(), lin.bias)
        replaced[name] = lin
    # every other tensor: norms, embeddings, biases outside linears, learned positions
    state = {}
    for key in state_names:
        module_name = key.rpartition(".")[0]
        if module_name in replaced or module_name == head_name:
            continue
        source = stored(key)
        if source is not None and source in dense:
            state[key] = r.tensor(source)
        elif stored(module_name) in quantized:  # a quantized non-linear module (an embedding table)
            qw = quantized[stored(module_name)]
            state[key] = dequantize(qw.codes, qw.scale, qw.zero_point, qw.group_size, dtype).to(backend.device)
    missing = [k for k in state_names - set(state)
               if k.rpartition(".")[0] not in replaced and k.rpartition(".")[0] != head_name]
    persistent_missing = [k for k in missing if k in dict(hf.named_parameters())]
    if persistent_missing:
        raise LlmoptError(f"{path} has no tensor '{sorted(persistent_missing)[0]}'", "the checkpoint does not fit its config.json; re-create it")
    hf.load_state_dict(state, strict=False, assign=True)
    # the output head: as stored, or the (tied) input embedding
    if head_name in replaced:
        head = replaced[head_name]
    else:
        if not arch.tie_word_embeddings:
            raise LlmoptError(f"{path} has no {head_name}.weight and its embeddings are not tied", "re-create the checkpoint")
        head = DenseLinear.from_weight(hf.get_input_embeddings().weight.detach())
    head_kind = "quantized" if not isinstance(head, DenseLinear) else "float" if lm_head == "auto" else lm_head
    if head_kind in ("int8", *HALF_HEADS):
        head = smaller_head(head, head_kind)
    if head_name is not None:
        replaced[head_name] = head
    modules = _linear_modules(hf)
    for name, lin in replaced.items():
        backend.prepare_linear(lin.inner if isinstance(lin, TransformedLinear) else lin)
        module = modules[name]
        width = module.in_features if isinstance(module, nn.Linear) else module.weight.shape[0]
        _set_module(hf, name, RuntimeLinear(lin, width))
    model = GenericModel(arch, hf, backend, max_model_len)
    _check_probe(model, arch, path)
    return model, GenericWeights(head, description, head_kind, hf)


def _checkpoint_names(hf: nn.Module, keys: list[str], path: Path) -> dict[str, str]:
    """Model tensor name -> checkpoint name: the stored name itself when the model has it (per-expert
    MoE tensors, Mixtral's ``block_sparse_moe.experts.j.w1`` under their unfused names), else through
    transformers' own renamings of stored keys (e.g. GPT-NeoX's ``embed_out`` is ``lm_head``; the
    base-model prefix); a checkpoint that needs tensors converted (merged, split) is refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = dict.fromkeys(hf.state_dict())
    found = {}
    for key in keys:
        if canonical_key(key) in meta:
            found[canonical_key(key)] = key
            continue
        renamed, converted = rename_source_key(key, renamings, converters, getattr(hf, "base_model_prefix", None), meta)
        if converted is not None:
            raise LlmoptError(f"the runtime cannot run '{hf.config.model_type}' ({path}): its checkpoint's tensors need "
                              f"converting ({key})", "run it with transformers directly")
        found[renamed] = key
    return found


def _check_probe(model: GenericModel, arch: ModelArch, path: Path) -> None:
    """Refuse a model whose forward does not attend through the interface once per layer with one
    head shape; that shape (heads, KV heads, head dim) becomes ``arch``'s: the KV cache, allocated
    after the model loads, is sized from it."""
    name = arch.model_type
    fix = "run it with transformers directly; the runtime's generic path needs attention through transformers' interface"
    try:
        seen = model.probe()
    except Exception as exc:  # noqa: BLE001 - any failure of foreign modeling code is a refusal
        raise LlmoptError(f"the runtime cannot run '{name}' ({path}): its transformers forward fails with the runtime's "
                          f"layers ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", fix) from exc
    if len(seen) != arch.num_layers:
        raise LlmoptError(f"the runtime cannot run '{name}' ({path}): its forward made {len(seen)} attention calls "
                          f"through transformers' interface, not one per layer ({arch.num_layers})", fix)
    for *_, unsupported in seen:
        if unsupported:
            raise LlmoptError(f"the runtime cannot run '{name}' ({path}): its attention uses {unsupported[0]} (attention sinks)", fix)
    shapes = {call[:3] for call in seen}
    if len(shapes) != 1:
        raise LlmoptError(f"the runtime cannot run '{name}' ({path}): its layers attend with different head shapes "
                          f"{sorted(shapes)}", fix)
    # what the code actually does sizes the KV cache (a config may carry fields its model ignores)
    arch.num_heads, arch.num_kv_heads, arch.head_dim = shapes.pop()


Model = GenericModel
