"""Offline rotations (QuaRot / SpinQuant's R1 and R2) fused into a checkpoint's weights.

An orthogonal ``Q`` applied to the residual stream leaves the model's function unchanged once
every RMSNorm's scale is folded into the Linears that read its output (RMS normalisation itself
commutes with rotations): the embedding becomes ``E Q``, every Linear reading the residual
``W Q``, every Linear writing it ``Qᵀ W`` and the head ``W diag(w) Q``. A second rotation ``H``
per attention head turns each value head into ``Hᵀ v`` and the output projection's matching
columns into ``W H``. The result is an ordinary checkpoint of the same architecture (norm scales
all one, the head untied from the embedding), run by every consumer; its weights have their
outliers spread over all features, which is what makes them easier to quantize.

``Q`` is a Hadamard matrix with random signs (Sylvester's construction times a Paley one, for
widths 2^a · (p + 1) with p a prime ≡ 3 mod 4, which covers the usual hidden sizes), scaled to
be orthogonal; widths without one get a random orthogonal matrix, and the record says so.
Each tensor is rotated in float64 and cast back to its stored dtype; :mod:`llmopt.pipeline.rotate`
rewrites a checkpoint with them tensor by tensor (bounded memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.core.errors import LlmoptError
from llmopt.formats.hadamard import fuse_into_weight

ROTATIONS = ("none", "hadamard", "orthogonal", "learned")
READERS_ATTN = ("q_proj", "k_proj", "v_proj", "qkv_proj")
READERS_MLP = ("gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "gate", "shared_expert_gate")
WRITERS = ("o_proj", "down_proj", "w2")
ROUTERS = ("gate", "shared_expert_gate")  # MoE routers: kept in float, so an online transform gains nothing
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")


# ---------------------------------------------------------------------------------------------
# Matrices


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _paley(q: int) -> torch.Tensor:
    """Paley's construction I: a Hadamard matrix of order q + 1 for a prime q ≡ 3 (mod 4)."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if i in squares else -1.0 for i in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]  # antisymmetric for q ≡ 3 mod 4
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:] = 1.0
    c[1:, 0] = -1.0
    c[1:, 1:] = jacobsthal
    return c + torch.eye(q + 1, dtype=torch.float64)


def hadamard(n: int) -> torch.Tensor | None:
    """A ±1 matrix ``H`` of order ``n`` with ``H Hᵀ = n I``, or None when this construction has none."""
    power = 1
    while n % (power * 2) == 0:
        power *= 2
    while power >= 1:
        m = n // power
        if m == 1:
            return _sylvester(n)
        if m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3:
            return torch.kron(_paley(m - 1), _sylvester(power))
        power //= 2
    return None


def rotation(n: int, kind: str, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """An orthogonal ``n × n`` float64 matrix and how it was made."""
    if kind == "hadamard":
        h = hadamard(n)
        if h is not None:
            signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.float64) * 2 - 1
            return h * signs[None, :] / n ** 0.5, "randomized Hadamard"
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :], "random orthogonal" + (" (no Hadamard of this order)" if kind == "hadamard" else "")


# ---------------------------------------------------------------------------------------------
# Tensors


def _role(rest: str) -> str | None:
    """``reads-attn`` / ``reads-mlp`` / ``writes`` for a layer's Linear (``self_attn.q_proj`` …), else None."""
    leaf = rest.rpartition(".")[2]
    if rest.startswith("self_attn.") and leaf in READERS_ATTN:
        return "reads-attn"
    if leaf in WRITERS:
        return "writes"
    if not rest.startswith("self_attn.") and leaf in READERS_MLP:
        return "reads-mlp"
    return None


def check_rotatable(config: dict) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        why = " (its norms after attention and MLP cannot be folded into a Linear)" if str(model_type).startswith("gemma") else ""
        raise LlmoptError(f"--rotate does not support the '{model_type}' architecture{why}",
                          f"rotate a {', '.join(SUPPORTED)} model, or drop --rotate")


@dataclass
class Rotation:
    """The residual rotation ``q`` and the per-head rotation ``h`` for one model, and how to apply them."""

    q: torch.Tensor
    h: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    record: dict

    @classmethod
    def for_config(cls, config: dict, kind: str, seed: int = 0,
                   residual: tuple[torch.Tensor, dict] | None = None) -> Rotation:
        """``kind`` ``learned`` takes the residual rotation and its record from ``residual``
        (:func:`llmopt.quant.learned_rotation.learn_residual_rotation`); its heads get Hadamards."""
        check_rotatable(config)
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        generator = torch.Generator().manual_seed(seed)
        q, made = rotation(hidden, "hadamard" if kind == "learned" else kind, generator)
        h, head_made = rotation(head_dim, "hadamard" if kind == "learned" else kind, generator)
        if kind == "learned":
            if residual is None or residual[0].shape != (hidden, hidden):
                raise ValueError(f"a learned rotation needs its {hidden} × {hidden} residual matrix")
            q, made = residual[0].double(), "learned (Cayley SGD from a randomized Hadamard)"
        record = {"kind": kind, "residual": f"{made}, {hidden} × {hidden}", "heads": f"{head_made}, {head_dim} × {head_dim}",
                  "seed": seed}
        if kind == "learned":
            record["learned"] = residual[1]
        return cls(q, h, heads, kv_heads, head_dim, record)

    def embedding(self, weight: torch.Tensor) -> torch.Tensor:
        return (weight.double() @ self.q).to(weight.dtype)

    def head(self, weight: torch.Tensor, final_norm: torch.Tensor) -> torch.Tensor:
        """The output head with the final norm's scale folded in, reading the rotated stream."""
        return ((weight.double() * final_norm.double()[None, :]) @ self.q).to(weight.dtype)

    def layer_tensor(self, rest: str, part: str, tensor: torch.Tensor, norms: dict[str, torch.Tensor],
                     online_block: int | None = None) -> torch.Tensor:
        """One decoder-layer tensor (``rest``: its module path in the layer; ``part``: weight / bias);
        ``norms``: the layer's input norms' scales by reader role (``reads-attn``, ``reads-mlp``);
        ``online_block``: the order of an online Hadamard on this Linear's input, fused in as well."""
        if rest in ("input_layernorm", "post_attention_layernorm"):
            return torch.ones_like(tensor)
        role = _role(rest)
        x = tensor.double()
        leaf = rest.rpartition(".")[2]
        if role is None:
            if tensor.dim() >= 2:
                raise LlmoptError(f"--rotate does not know how to rotate {rest} ({part})", "drop --rotate for this model")
            return tensor  # q_norm / k_norm act per head, after the projections: unchanged
        if role == "writes":
            if leaf == "o_proj" and part == "weight":  # the value heads' rotation, undone on the inputs
                x = (x.reshape(x.shape[0], self.heads, self.head_dim) @ self.h).reshape(x.shape)
            x = self.q.T @ x
            if online_block is not None and part == "weight":
                x = fuse_into_weight(x, online_block)
            return x.to(tensor.dtype)
        # a reader: the output rows of v (or of v inside a fused qkv) are rotated per head
        v_rows = _value_rows(leaf, x.shape[0], self.heads, self.kv_heads, self.head_dim)
        if v_rows is not None:
            v = x[v_rows]
            x = x.clone()
            x[v_rows] = (self.h.T @ v.reshape(self.kv_heads, self.head_dim, -1)).reshape(v.shape)
        if part == "weight":
            x = (x * norms[role][None, :]) @ self.q
            if online_block is not None:
                x = fuse_into_weight(x, online_block)
        return x.to(tensor.dtype)


def transformable_linears(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The decoder Linears an online input transform may go on, by their path in the layer
    (``self_attn.q_proj`` …), with their input widths; ``shapes``: a layer's tensors by that path
    and part (``self_attn.q_proj.weight``). MoE experts (fused into 3-D tensors in memory) and
    routers are left out."""
    found = {}
    for key, shape in shapes.items():
        rest, _, part = key.rpartition(".")
        leaf = rest.rpartition(".")[2]
        if part == "weight" and len(shape) == 2 and _role(rest) is not None and leaf not in ROUTERS and ".experts." not in f".{rest}.":
            found[rest] = int(shape[1])
    return found


def _value_rows(leaf: str, rows: int, heads: int, kv_heads: int, head_dim: int) -> slice | None:
    if leaf == "v_proj":
        return slice(0, rows)
    if leaf == "qkv_proj":
        start = (heads + kv_heads) * head_dim
        return slice(start, start + kv_heads * head_dim)
    return None
