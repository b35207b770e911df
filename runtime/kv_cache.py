"""The paged KV cache: per layer K and V tensors, with scales when quantized."""

from __future__ import annotations

import torch
from llmopt.formats.hadamard import block_for, hadamard_matrix

from .config import ModelArch
from .kernels import kv_quant
from .kernels.reference import Workspace, write_kv
from .kv_sinks import SINK_TOKENS, SPARE_ENTRIES, SinkTable
from .rope import block_means


FLOAT16_MAX = torch.finfo(torch.float16).max  # key offsets are kept in float16
KEY_SCALE_POWER = 0.15  # chosen on the demo model by a sweep of 0-0.3 (bench/results/kv_int4_error.md)


class KVCache:
    """Per layer K and V tensors ``[kv_heads, num_blocks * block_size, head_dim]``.

    ``kv_cache_dtype`` ``auto`` stores values in the model's dtype; ``int8`` / ``fp8`` store
    codes (one byte each) with float32 scales ``[kv_heads, num_blocks * block_size]`` per layer
    (one per token and KV head, see ``kernels.kv_quant``); ``int4`` packs two codes per byte
    (last dimension ``head_dim / 2``) with a float16 (scale, minimum) pair per group of 32 values
    of a token and KV head (``int4_g16``: of 16; scales ``[kv_heads, slots, groups, 2]``).

    An int4 cache holds K and V in a rotated basis: ``rotation`` (a block-diagonal Hadamard
    matrix over ``head_dim``, orthogonal and symmetric) multiplies queries, keys and values
    after RoPE (:meth:`rotate`), which leaves every score unchanged, and the attention output
    is rotated back (:meth:`unrotate_output`). Before the rotation, each key channel is
    multiplied by a calibrated factor and each query channel divided by it (``key_scale``, per
    layer and KV head), which leaves every score unchanged and moves key magnitude out of the
    channels the queries weigh most, where int4 error costs most (factor ``(E q² / Var k) **
    KEY_SCALE_POWER``, geometric mean 1). Keys are stored less a per-layer, per-head offset of
    their block of positions (``k_offsets`` ``[kv_heads, blocks, head_dim]`` float16, row
    ``position // block_size``, as many rows as a sequence can fill: the model length's blocks,
    at most the cache's), which the attention kernels add back as they read: a
    calibrated mean key before RoPE turned by the block's average RoPE rotation (RoPE turns a
    key's slow pairs by its position, so one fixed offset fits only the positions it was
    calibrated on), or the plain mean key where that fits the calibration text better (layers
    without RoPE). Centring the keys halves their int4 error. The engine calibrates scales and
    offsets (:meth:`begin_basis_calibration`, ``runtime.kv_calibration``). An int4 cache also keeps each
    sequence's first ``SINK_TOKENS`` keys and values (its attention sinks) in float32, in the
    same basis, in ``max_num_seqs + SPARE_ENTRIES`` entries (``sink_k`` / ``sink_v``
    ``[kv_heads, entries, SINK_TOKENS, head_dim]`` per layer; ``runtime.kv_sinks``) that the
    attention kernels read in place of those positions' codes.

    Allocated once with ``torch.empty``: the operating system backs pages only as blocks are
    first written, so resident memory follows the blocks actually used.
    """

    def __init__(self, arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 device: torch.device | str = "cpu", max_num_seqs: int = 64) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.head_dim = arch.head_dim
        self.kv_cache_dtype = kv_cache_dtype
        storage = kv_quant.storage_dtype(kv_cache_dtype, dtype)
        slots = num_blocks * block_size
        stored_dim = arch.head_dim // kv_quant.values_per_element(kv_cache_dtype)
        shape = (arch.num_layers, 2, arch.num_kv_heads, slots, stored_dim)
        self.data = torch.empty(shape, dtype=storage, device=device)
        self.k = [self.data[i, 0] for i in range(arch.num_layers)]
        self.v = [self.data[i, 1] for i in range(arch.num_layers)]
        self.scales = None
        self.k_scale: list[torch.Tensor | None] = [None] * arch.num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * arch.num_layers
        if kv_quant.is_quantized(kv_cache_dtype):
            self.scales = torch.empty(shape[:-1] + kv_quant.scale_shape(kv_cache_dtype, arch.head_dim),
                                      dtype=kv_quant.scale_dtype(kv_cache_dtype), device=device)
            self.k_scale = [self.scales[i, 0] for i in range(arch.num_layers)]
            self.v_scale = [self.scales[i, 1] for i in range(arch.num_layers)]
        self.k_space = Workspace(storage, device)  # scratch for gathered context, reused by every layer
        self.v_space = Workspace(storage, device)
        self.rotation: torch.Tensor | None = None
        self.k_offsets: list[torch.Tensor | None] = [None] * arch.num_layers  # [kv_heads, blocks, head_dim] float16
        self.key_scale: list[torch.Tensor | None] = [None] * arch.num_layers  # [kv_heads, head_dim] float32
        self._basis_stats: list[dict] | None = None  # per layer while calibrating, see _record
        self._rope_blocks: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer while calibrating
        self._factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (key_scale, _basis_factors)
        block = block_for(arch.head_dim) if kv_quant.is_int4(kv_cache_dtype) else None
        if block is not None:
            h = hadamard_matrix(block, torch.float64)
            self.rotation = torch.block_diag(*[h] * (arch.head_dim // block)).to(dtype=dtype, device=device)
        self.sinks: SinkTable | None = None
        self.sink_k: list[torch.Tensor | None] = [None] * arch.num_layers
        self.sink_v: list[torch.Tensor | None] = [None] * arch.num_layers
        if kv_quant.is_int4(kv_cache_dtype) and block_size >= SINK_TOKENS:
            entries = max_num_seqs + SPARE_ENTRIES
            self.sinks = SinkTable(entries)
            self.sink_data = torch.zeros(arch.num_layers, 2, arch.num_kv_heads, entries, SINK_TOKENS, arch.head_dim,
                                         dtype=torch.float32, device=device)
            self.sink_k = [self.sink_data[i, 0] for i in range(arch.num_layers)]
            self.sink_v = [self.sink_data[i, 1] for i in range(arch.num_layers)]

    @staticmethod
    def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        element = torch.empty((), dtype=kv_quant.storage_dtype(kv_cache_dtype, dtype)).element_size()
        per_token_head = arch.head_dim // kv_quant.values_per_element(kv_cache_dtype) * element
        if kv_quant.is_quantized(kv_cache_dtype):
            scales = 1
            for n in kv_quant.scale_shape(kv_cache_dtype, arch.head_dim):
                scales *= n
            per_token_head += scales * torch.empty((), dtype=kv_quant.scale_dtype(kv_cache_dtype)).element_size()
        return arch.num_layers * 2 * arch.num_kv_heads * block_size * per_token_head

    @property
    def nbytes(self) -> int:
        total = self.data.numel() * self.data.element_size()
        if self.scales is not None:
            total += self.scales.numel() * self.scales.element_size()
        if self.sinks is not None:
            total += self.sink_data.numel() * self.sink_data.element_size()
        return total + sum(o.numel() * o.element_size() for o in self.k_offsets if o is not None)

    # -- the rotated basis of an int4 cache ------------------------------------------------------
    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., head_dim]`` in the cache's basis (itself when the cache is not rotated)."""
        return x if self.rotation is None else torch.matmul(x, self.rotation.to(x.dtype))

    def unrotate_output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output ``[tokens, heads * head_dim]`` back from the cache's basis."""
        if self.rotation is None:
            return out
        return self.rotate(out.view(out.shape[0], -1, self.head_dim)).view(out.shape)

    def to_cache_basis(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q`` ``[tokens, heads, head_dim]`` and ``k`` / ``v`` ``[tokens, kv_heads, head_dim]``
        of layer ``index`` (after RoPE) in the cache's basis: keys scaled and queries unscaled
        by ``key_scale``, all three rotated. Themselves when the cache is not rotated."""
        if self.rotation is None:
            return q, k, v
        heads, kv_heads = q.shape[1], k.shape[1]
        qkv = self.qkv_to_cache_basis(torch.cat([q, k, v], dim=1), heads, index)
        return qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]

    def qkv_to_cache_basis(self, qkv: torch.Tensor, heads: int, index: int) -> torch.Tensor:
        """:meth:`to_cache_basis` on ``[tokens, heads + 2 * kv_heads, head_dim]`` (queries, keys,
        values of one layer side by side), in two operations: one scaling, one rotation."""
        if self.rotation is None:
            return qkv
        kv_heads = (qkv.shape[1] - heads) // 2
        if self._basis_stats is not None:
            self._record(index, qkv[:, :heads], qkv[:, heads:heads + kv_heads])
        factors = self._basis_factors(index, heads, qkv.dtype)
        if factors is not None:
            qkv = qkv * factors
        return torch.matmul(qkv, self.rotation.to(qkv.dtype))

    def _basis_factors(self, index: int, heads: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``[heads + 2 * kv_heads, head_dim]`` multipliers of layer ``index``: one over the key
        scale for each query head (its KV head's), the key scale for keys, 1 for values."""
        scale = self.key_scale[index]
        if scale is None:
            return None
        cached = self._factors.get(index)
        if cached is None or cached[0] is not scale or cached[1].shape[0] != heads + 2 * scale.shape[0] or cached[1].dtype != dtype:
            exact = scale.double()  # the reciprocal rounded once, in the model's dtype
            queries = (1 / exact).repeat_interleave(heads // scale.shape[0], dim=0)
            cached = (scale, torch.cat([queries, exact, torch.ones_like(exact)]).to(dtype))
            self._factors[index] = cached
        return cached[1]

    def store(self, index: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              sink_writes: tuple[torch.Tensor, torch.Tensor] | None = None, key_blocks: torch.Tensor | None = None) -> None:
        """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` (already in the cache's basis) of
        layer ``index`` at ``slots``, keys less their block's offset (``key_blocks`` ``[tokens]``:
        each token's ``position // block_size``); and the attention sinks among them
        (:meth:`store_sinks`)."""
        write_kv(self.k[index], self.v[index], self.centred_keys(index, k, key_blocks), v, slots,
                 self.k_scale[index], self.v_scale[index])
        self.store_sinks(index, k, v, sink_writes)

    def centred_keys(self, index: int, k: torch.Tensor, key_blocks: torch.Tensor | None) -> torch.Tensor:
        """``k`` ``[tokens, kv_heads, head_dim]`` less each token's block offset (itself without offsets)."""
        offsets = self.k_offsets[index]
        if offsets is None:
            return k
        if key_blocks is None or key_blocks.shape != k.shape[:1]:
            raise ValueError("a cache with key offsets needs each token's block of positions (key_blocks [tokens])")
        return k - offsets.index_select(1, key_blocks).transpose(0, 1).to(k.dtype)

    def store_sinks(self, index: int, k: torch.Tensor, v: torch.Tensor,
                    sink_writes: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy the attention sinks among ``k``/``v`` (cache basis, key offsets not removed) into
        the sink store, keys less the first block's offset: ``sink_writes`` is (batch rows of
        each sequence's position 0, their entries), ``SINK_TOKENS`` rows from each."""
        if sink_writes is None:
            return
        rows, entries = sink_writes
        positions = (rows[:, None] + torch.arange(SINK_TOKENS, device=rows.device)).flatten()
        offsets = self.k_offsets[index]
        for store, x, first in ((self.sink_k[index], k, offsets), (self.sink_v[index], v, None)):
            values = x.index_select(0, positions).view(len(entries), SINK_TOKENS, *x.shape[1:]).float()
            if first is not None:
                values = values - first[:, 0]
            store[:, entries] = values.permute(2, 0, 1, 3)  # [kv_heads, entries, SINK_TOKENS, head_dim]

    def offsets_of(self, index: int) -> torch.Tensor | None:
        """Layer ``index``'s key offsets ``[kv_heads, blocks, head_dim]`` float16 (None: none)."""
        return self.k_offsets[index]

    def sinks_of(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``index``'s sink store (K, V), None when the cache keeps none."""
        return None if self.sinks is None else (self.sink_k[index], self.sink_v[index])

    def begin_basis_calibration(self, rope_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Collect per layer and KV head the statistics of the key scales and offsets (key means,
        variances and RoPE-block moments, query mean squares) over the following
        :meth:`to_cache_basis` calls, which must run one sequence's positions 0, 1, ... in order
        (scales and offsets off meanwhile). ``rope_tables``: per layer, the cos and signed sin
        rows ``[positions, head_dim]`` (``runtime.rope``) its keys are turned by; without them,
        offsets are plain mean keys."""
        self.k_offsets = [None] * len(self.k)
        self.key_scale = [None] * len(self.k)
        if self.sinks is not None:
            self.sinks.clear()
        self._rope_blocks = None
        if rope_tables is not None:
            if len(rope_tables) != len(self.k):
                raise ValueError(f"{len(rope_tables)} RoPE tables for a cache of {len(self.k)} layers")
            averaged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layers sharing a table share its averages
            for cos, sin in rope_tables:
                if id(cos) not in averaged:
                    averaged[id(cos)] = block_means(cos, self.block_size).double(), block_means(sin, self.block_size).double()
            self._rope_blocks = [averaged[id(cos)] for cos, _ in rope_tables]
        self._basis_stats = [{"count": 0} for _ in self.k]

    def _record(self, index: int, q: torch.Tensor, k: torch.Tensor) -> None:
        keys = k.double()
        queries = q.double().reshape(q.shape[0], k.shape[1], -1, q.shape[-1])  # a KV head's query group
        stats = self._basis_stats[index]
        first = stats["count"]
        sums = {"key": keys.sum(0), "key_squares": keys.square().sum(0), "query_squares": queries.square().mean(2).sum(0)}
        if self._rope_blocks is not None:
            blocks = torch.arange(first, first + k.shape[0], device=k.device) // self.block_size
            cos, sin = (t.to(k.device)[blocks] for t in self._rope_blocks[index])  # [tokens, head_dim]
            sums.update(cos_key=(keys * cos[:, None]).sum(0), sin_key=(keys * sin[:, None]).sum(0),
                        cos2=cos.square().sum(0), sin2=sin.square().sum(0), cos_sin=(cos * sin).sum(0))
        for name, value in sums.items():
            stats[name] = stats.get(name, 0) + value
        stats["count"] = first + k.shape[0]

    def end_basis_calibration(self, offsets: bool = True) -> None:
        """Set ``key_scale`` (and ``k_offsets`` unless ``offsets`` is False) from the collected
        statistics; layers that saw no token keep neither."""
        stats_of, self._basis_stats = self._basis_stats, None
        if self.sinks is not None:  # written in the basis being replaced
            self.sinks.clear()
        for index, stats in enumerate(stats_of):
            count = stats["count"]
            if not count:
                continue
            mean = stats["key"] / count
            variance = (stats["key_squares"] / count - mean.square()).clamp_min(0)
            query_power = stats["query_squares"] / count
            floor = torch.finfo(torch.float32).tiny
            ratio = (query_power + 1e-6 * query_power.mean(-1, keepdim=True) + floor) / (
                variance + 1e-6 * variance.mean(-1, keepdim=True) + floor)
            scale = ratio.pow(KEY_SCALE_POWER)
            scale = scale / scale.log().mean(-1, keepdim=True).exp()
            self.key_scale[index] = scale.to(torch.float32)
            if offsets:
                rows = self.rotate(self._offset_rows(index, stats, mean, scale) * scale[:, None])
                # float16 halves the table; written and read alike, so its rounding costs only centring
                self.k_offsets[index] = rows.clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)
        self._rope_blocks = None

    def _offset_rows(self, index: int, stats: dict, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s key offsets ``[kv_heads, blocks, head_dim]`` in the original basis (float64): per KV
        head, the least-squares fit of the keys by ``mu`` turned by each key's block-average
        RoPE rotation (``A_b mu``: each pair of ``mu`` rotated and shrunk as the block's rows
        average), or the mean key in every block where that leaves less key energy (weighted
        by the squared key scales, the int4 rounding's basis). ``A_b`` keeps pairs orthogonal,
        so the fit is one division per channel."""
        if self._rope_blocks is None:
            return mean[:, None, :].expand(-1, self.num_blocks, -1)
        cos, sin = (t[:self.num_blocks] for t in self._rope_blocks[index])  # [blocks, head_dim]: no sequence spans more
        half = mean.shape[-1] // 2

        def partner(x: torch.Tensor) -> torch.Tensor:  # each channel's RoPE pair partner
            return torch.roll(x, half, -1)

        normal = stats["cos2"] + partner(stats["sin2"])
        mu = (stats["cos_key"] + partner(stats["sin_key"])) / normal.clamp_min(torch.finfo(torch.float64).tiny)
        weight = scale.square()
        fitted = (-2 * (mu * stats["cos_key"] + partner(mu) * stats["sin_key"]) + mu.square() * stats["cos2"]
                  + 2 * mu * partner(mu) * stats["cos_sin"] + partner(mu).square() * stats["sin2"])
        gain_rotating = -(weight * fitted).sum(-1)  # key energy the fit removes, per KV head
        gain_constant = stats["count"] * (weight * mean.square()).sum(-1)
        rotating = cos[None] * mu[:, None] + sin[None] * partner(mu)[:, None]  # [kv_heads, blocks, head_dim]
        constant = mean[:, None, :].expand_as(rotating)
        return torch.where((gain_rotating > gain_constant)[:, None, None], rotating, constant)
