"""Peak-memory bound of a streamed compression job, from the checkpoint's shapes alone.

The bound is the largest of what the streaming path holds at once in each phase of a layer:

- capture: the input embedding in float32 while layer 0's inputs are captured, and the
  calibration activations;
- observe: the layer in float32 (plus one stored tensor while it is read), the float64 Hessian
  accumulators of its distinct Linear inputs (q/k/v and gate/up share one) plus one batch's
  ``xᵀx`` product, the calibration activations (stored layer inputs, the next layer's inputs
  being built, one mini-batch's intermediates);
- solve: the layer, the accumulators not solved yet, and the solver's working memory for the
  Linear being solved — for GPTQ two float64 ``[n, n]`` matrices (the Hessian, permuted and
  factored in place, and its Cholesky factor) and float32 working copies of the stacked
  weights (see :func:`llmopt.quant.gptq.gptq_quantize_weight`); for RTN the quantize / pack
  temporaries of the largest Linear and the layer's codes; the stored layer inputs;
- write: the layer and the output-shard buffer twice (``save_file`` serializes it to bytes);
- one-pass GPTQ: the layer, every batch's intermediates paused mid-layer, and one group's
  Hessian and solver working memory (solved while they wait);
- GPTQ with float targets (``reference``): a float copy of the layer, the float model's hidden
  states (as many as the stored inputs), each batch's float forward in flight (paused with its
  batch in one-pass GPTQ), a float64 ``Σ (x − x̃) x̃ᵀ`` accumulator next to each Hessian, and the
  float-target solve (its inverse factor and right-hand side) before GPTQ.

Plus the process's own baseline (Python, torch, transformers). :func:`check_fits` refuses a job
whose bound exceeds the free memory, saying what to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llmopt.core.errors import LlmoptError

HESSIAN_METHODS = ("gptq", "sparsegpt", "awq", "clip")
IN_PLACE_FACTOR_MIN = 4096  # Hessians this wide are factored in place (llmopt.quant.gptq._factor_in_place)
GIB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes per component and their peak (the max over the phases of the module docstring)."""

    layer: int
    hessians: int  # accumulators + one batch's product, while the layer is observed
    activations: int  # everything the calibration forward holds
    embedding: int
    shard_buffer: int  # twice the shard size
    baseline: int
    solver: int = 0  # accumulators left + the solver's working memory, at its worst Linear
    stored: int = 0  # the stored layer inputs (what the activations leave while solving)
    one_pass: int = 0  # one-pass GPTQ: a group's Hessian and solver while every batch waits mid-layer

    @property
    def peak(self) -> int:
        shard = self.shard_buffer // 2
        phases = (
            self.embedding + self.activations,  # capture
            self.layer + self.hessians + self.activations + shard,  # observe
            self.layer + self.solver + self.stored + shard,  # solve
            self.layer + self.stored + self.shard_buffer,  # write a shard
            self.layer + self.one_pass + shard,  # one-pass GPTQ: solve while the batches wait
        )
        return self.baseline + max(phases)

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "peak": self.peak}

    def describe(self) -> str:
        g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
        return (f"estimated peak memory {g(self.peak)} GiB (layer {g(self.layer)}, Hessians {g(self.hessians)}, "
                f"solver {g(self.solver)}, activations {g(self.activations)}, embedding {g(self.embedding)}, "
                f"output buffer {g(self.shard_buffer)}, process {g(self.baseline)})")


def layer_shapes(config: dict) -> dict[str, int]:
    """hidden, intermediate, attention width, KV width, vocabulary and layer count of a Llama-style config."""
    text = config.get("text_config") or config
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv = int(text.get("num_key_value_heads") or heads)
    return {"hidden": hidden, "inter": int(text["intermediate_size"]), "attn": heads * head_dim,
            "kv": kv * head_dim, "vocab": int(text["vocab_size"]), "layers": int(text["num_hidden_layers"]),
            "heads": heads}


def estimate_memory(
    config: dict,
    stored_bytes_per_value: int,
    *,
    hessian: bool,
    n_samples: int = 0,
    seq_len: int = 0,
    batch_size: int = 8,
    output_bytes: int = 0,
    shard_bytes: int = GIB,
    baseline: int = 0,
    one_pass: bool = False,
    reference: bool = False,
) -> MemoryEstimate:
    """The bound for streaming one model of ``config`` (see the module docstring); ``one_pass``:
    GPTQ in one lockstep pass (:func:`llmopt.quant.apply._gptq_one_pass`), which solves each
    group while every batch waits with its intermediates (at most ``i + 2h`` values a token);
    ``reference``: GPTQ with float targets (:class:`llmopt.float_reference.FloatReference`)."""
    s = layer_shapes(config)
    h, i, a, kv = s["hidden"], s["inter"], s["attn"], s["kv"]
    layer_params = h * (a + 2 * kv) + a * h + 3 * h * i + 2 * h
    layer = layer_params * 4 * (2 if reference else 1) + max(h * i, h * a) * stored_bytes_per_value  # float32 layer(s) + one stored tensor
    # (inputs, stacked output rows) per shared input, in the order GPTQ solves them: q/k/v, o, gate/up, down
    linears = [(h, a + 2 * kv), (a, h), (h, 2 * i), (i, h)]
    accumulators = 2 if reference else 1  # a Hessian (and a drift term) per shared input
    hessians = solver = 0
    if hessian:
        hessians = 8 * accumulators * sum(n * n for n, _ in linears) + 4 * max(n for n, _ in linears) ** 2
        solver = max(8 * accumulators * sum(n * n for n, _ in linears[k + 1:]) + _solve_workspace(n, o, reference)
                     for k, (n, o) in enumerate(linears))
    else:  # RTN: three float32 temporaries of the largest Linear (quantize / pack), the layer's int8 codes
        solver = 3 * 4 * max(h * i, h * a) + layer_params
    tokens = n_samples * seq_len
    batch_tokens = min(batch_size, max(n_samples, 1)) * seq_len
    stored = 4 * tokens * h * (2 if reference else 1)  # (and the float model's hidden states)
    activations = 2 * stored  # stored inputs + the next layer's outputs being built
    activations += 4 * batch_tokens * (3 * i + 2 * a + 2 * kv + 2 * h) * (2 if reference else 1)  # one mini-batch in flight (and its float forward)
    activations += 4 * min(batch_size, max(n_samples, 1)) * s["heads"] * seq_len * seq_len  # attention scores
    embedding = s["vocab"] * h * (4 + stored_bytes_per_value)
    waiting = 0
    if one_pass and n_samples:
        waiting = (2 * stored + 4 * tokens * (i + 2 * h) * (2 if reference else 1)  # (and every float forward paused too)
                   + max(_solve_workspace(n, o, reference) for n, o in linears))  # (the accumulator becomes its Hessian)
    return MemoryEstimate(layer, hessians, activations if n_samples else 0, embedding if n_samples else 0,
                          2 * (min(shard_bytes, output_bytes) if output_bytes else shard_bytes), baseline,
                          solver, stored, waiting)


def _solve_workspace(n: int, rows: int, reference: bool) -> int:
    """The larger of GPTQ's workspace and, with float targets, the float-target solve's (its
    Hessian and drift term, a float64 factor and its factorization copy, the right-hand side)."""
    gptq = _gptq_workspace(n, rows)
    return max(gptq, 8 * 4 * n * n + 8 * 2 * n * rows) if reference else gptq


def _gptq_workspace(n: int, rows: int) -> int:
    """GPTQ's peak for one stacked weight ``[rows, n]`` beyond the layer: the largest of factoring
    (Hessian + Cholesky factor in float64, the transposed weights), the qparams search (Hessian,
    two float32 weight copies, the search's temporaries over blocks of 2²⁴ weights) and the
    column loop (float32 factor; weights, codes and mask transposed), plus the scale refit's float32
    copies of the Hessian and weights kept across its two passes and its normal equations
    (:mod:`llmopt.quant.scale_refit`, 2²² float64 entries) or the code descent's four float32
    working matrices over a block of rows (:mod:`llmopt.quant.code_descent`, 2²³ entries each)."""
    w = 4 * n * rows
    search = 4 * 6 * min(n * rows, 1 << 24)
    factor = 12 * n * n if n >= IN_PLACE_FACTOR_MIN else 16 * n * n  # Hessian + factor (+ its float32 copy)
    refit = 4 * n * n + w + max(8 * (1 << 22), 4 * 4 * min(n * rows, 1 << 23))
    return refit + max(factor + w, 8 * n * n + 2 * w + search, 4 * n * n + 3 * w)


def available_bytes(device: str = "cpu") -> int:
    """Free memory of the host (``MemAvailable``) or of the current CUDA device."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def process_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def check_fits(estimate: MemoryEstimate, device: str = "cpu", available: int | None = None) -> None:
    """Refuse (one clear line) when the estimate does not fit in the free memory."""
    free = available_bytes(device) + estimate.baseline if available is None else available
    if estimate.peak > free:
        raise LlmoptError(
            f"this job needs about {estimate.peak / GIB:.1f} GiB ({estimate.describe()}) but only "
            f"{free / GIB:.1f} GiB is free{' on the GPU' if device.startswith('cuda') else ''}",
            "use fewer or shorter calibration samples (--calib-samples / --calib-seq-len), a smaller "
            "batch, --device cpu for a GPU too small, or free memory",
        )
