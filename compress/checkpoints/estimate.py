"""Peak-memory bound of a streamed compression job, from the checkpoint's shapes alone.

The bound is what the streaming path holds at once: the largest decoder layer in float32 (plus
one stored tensor while it is read), the Hessians of that layer's Linear inputs (float64, for
methods that need them) or the solver's working copies of the largest one, the calibration
activations (stored layer inputs in float32 plus one mini-batch's intermediates), the input
embedding in float32 while layer 0's inputs are captured, the output-shard buffer (twice: it is
serialized to bytes when written), and the
process's own baseline (Python, torch, transformers). :func:`check_fits` refuses a job whose
bound exceeds the free memory, saying what to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llmopt.core.errors import LlmoptError

HESSIAN_METHODS = ("gptq", "sparsegpt", "awq", "clip")
GIB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes per component and their peak (the max of the capture phase and the layer phase)."""

    layer: int
    hessians: int
    activations: int
    embedding: int
    shard_buffer: int
    baseline: int

    @property
    def peak(self) -> int:
        layer_phase = self.layer + self.hessians + self.activations + self.shard_buffer
        capture_phase = self.embedding + self.activations
        return self.baseline + max(layer_phase, capture_phase)

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "peak": self.peak}

    def describe(self) -> str:
        g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
        return (f"estimated peak memory {g(self.peak)} GiB (layer {g(self.layer)}, Hessians {g(self.hessians)}, "
                f"activations {g(self.activations)}, embedding {g(self.embedding)}, output buffer {g(self.shard_buffer)}, "
                f"process {g(self.baseline)})")


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
) -> MemoryEstimate:
    """The bound for streaming one model of ``config`` (see the module docstring)."""
    s = layer_shapes(config)
    h, i, a, kv = s["hidden"], s["inter"], s["attn"], s["kv"]
    layer_params = h * (a + 2 * kv) + a * h + 3 * h * i + 2 * h
    layer = layer_params * 4 + max(h * i, h * a) * stored_bytes_per_value  # float32 layer + one stored tensor
    hessians = 0
    if hessian:
        inputs = [h, a, h, i]  # q/k/v, o, gate/up, down
        # float64: every accumulator while the layer is observed; then, solving the largest (the
        # others freed), the Hessian, its shifted copy / Cholesky factor, the identity and the inverse
        hessians = max(8 * sum(n * n for n in inputs) + 4 * max(inputs) ** 2, 8 * 4 * max(inputs) ** 2)
    tokens = n_samples * seq_len
    batch_tokens = min(batch_size, max(n_samples, 1)) * seq_len
    activations = 4 * tokens * h * 2  # stored inputs + the next layer's outputs being built
    activations += 4 * batch_tokens * (3 * i + 2 * a + 2 * kv + 2 * h)  # one mini-batch in flight
    activations += 4 * min(batch_size, max(n_samples, 1)) * s["heads"] * seq_len * seq_len  # attention scores
    embedding = s["vocab"] * h * (4 + stored_bytes_per_value)
    return MemoryEstimate(layer, hessians, activations if n_samples else 0, embedding if n_samples else 0,
                          2 * (min(shard_bytes, output_bytes) if output_bytes else shard_bytes), baseline)


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
