"""The decoder-only transformer (Llama, Qwen2, Qwen3 dense) over a slot-addressed KV pool.

One forward pass serves prefill, decode and restore alike: every new token is
embedded, its K/V is written into the pool slot the engine chose, and each
sequence attends to exactly the slots it lists (drops are slots left out; a
restore's segment visibility is an explicit mask). Weights are plain tensors
behind small projections (`linear.Linear`: fp32, fp16 or mixed precision;
`quantized`: int8 or int4), q/k/v and gate/up fused, so a decode step is a
few large matmuls per layer and no module machinery. Logits are computed
only for the rows asked for.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from akv_core.kernels import cpu_gemv
from akv_core.model.batch import ForwardBatch, MassProbe, SeqAttention
from akv_core.model.config import ModelConfig
from akv_core.model.kv_buffers import KVBuffers
from akv_core.model.linear import GEMV_ROWS, Projection
from akv_core.model.prefill import PrefillPath, attention_switch
from akv_core.model.prefill_attention import causal_attention_bf16
from akv_core.model.rope import Rope

# Queries per attention call in a long prefill: each chunk sees only the keys up to its own
# end, so the causal upper triangle is mostly skipped instead of computed and masked.
PREFILL_CHUNK = 512

# The mask of a chunk whose causal attention runs in the prefill path's own blockwise kernel (`_attend_chunk`):
# bf16 products on the bf16 path, the fp32 flash attention of `cpu_gemv` on the float32 one; never `attend`'s.
BLOCK_CAUSAL = "block-causal"

# The kernels a prompt's causal attention may run on (`CausalLM.prefill_attention`, named in /server_info).
BF16_BLOCKS, FP32_FLASH, TORCH_SDPA = "bf16 blocks", "fp32 flash (cpu_gemv)", "torch's SDPA"

# The float32 path's C flash attention takes a sequence of at least this many new tokens (`CausalLM.flash_min_rows`);
# on fewer, torch's SDPA is as fast (2 threads, whole forward, SDPA's time over the kernel's, `python
# benchmarks/prefill_attention.py --parts prefill --prefill-tokens 32,64,512 --prefill-continued
# 40/4000,64/4000,100/2000,300/2000 --flash-min-rows 1 --rounds 5`: 0.97x for a fresh 32, 1.02x for 40 new
# tokens after 3,960, 1.08x for a fresh 64, 1.10x for 64 after 3,936, 1.07-1.13x for 100-512: docs/benchmarks.md,
# "Prefill attention").
FLASH_MIN_ROWS = 64

AttentionProbe = Callable[[int, int, Tensor, Tensor], None]


@dataclass(frozen=True)
class KernelAttention:
    """A decode-only pass's attention arguments for `cpu_gemv.decode_attention`, the same in every layer."""

    cos: Tensor       # [M, rotary]
    sin: Tensor       # signed sin [M, rotary]
    slots: Tensor     # every sequence's visible slots, concatenated
    offsets: Tensor   # [M + 1]: sequence m's slots are slots[offsets[m]:offsets[m + 1]]
    mass: Tensor | None = None   # the rows' attention weights, added layer after layer (`MassProbe`)


@dataclass
class LayerWeights:
    """One transformer block; q/k/v rows are in Hugging Face order (rotate-half RoPE)."""

    attn_norm: Tensor
    qkv: Projection             # [(H + 2*Hkv) * D, hidden], Qwen2 with a bias
    q_norm: Tensor | None       # Qwen3, [D]
    k_norm: Tensor | None
    o: Projection               # [hidden, H * D]
    mlp_norm: Tensor
    gate_up: Projection         # [2 * intermediate, hidden]
    down: Projection            # [hidden, intermediate]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in fp32, as the reference implementations do."""
    x32 = x.float()
    scale = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return weight * (x32 * scale).to(x.dtype)


def visibility_mask(seq: SeqAttention, rows: slice | None = None) -> Tensor | None:
    """The [q, K] bool mask of `seq` (None when every query sees every listed slot)."""
    if seq.mask is not None:
        return seq.mask if rows is None else seq.mask[rows]
    start, stop = (0, seq.q_len) if rows is None else (rows.start, rows.stop)
    if stop - start == 1 and stop == seq.q_len:
        return None  # the last new token sees everything listed
    num_keys = seq.kv_slots.numel() - seq.q_len + stop
    query = torch.arange(start, stop, device=seq.kv_slots.device)[:, None]
    key = torch.arange(num_keys, device=seq.kv_slots.device)[None, :]
    return key <= query + (seq.kv_slots.numel() - seq.q_len)


class CausalLM:
    """A loaded model: `forward(batch, kv)` returns fp32 logits for `batch.logits_rows`."""

    def __init__(self, config: ModelConfig, embed: Tensor, layers: list[LayerWeights], final_norm: Tensor,
                 lm_head: Projection, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.dtype = dtype
        self.device = torch.device(device)
        self.rope = Rope(config, device=device)
        self.attention_probe: AttentionProbe | None = None
        self.mass_probe: MassProbe | None = None
        self._scale = config.head_dim ** -0.5
        # Why the C kernels (akv_core.kernels.cpu_gemv) do not run for this model, with the fix; None where they
        # run, or off the CPU, where none is asked for. `akv serve` names it at start-up and in /server_info.
        self.kernels_refusal: cpu_gemv.Refusal | None = cpu_gemv.refusal() if self.device.type == "cpu" else None
        self.fused_decode = self._can_fuse_decode()
        self._attention_kernel = (self.device.type == "cpu" and config.head_dim % 8 == 0
                                  and config.rotary_dim <= min(config.head_dim, 512)
                                  and all(w.q_norm is None for w in layers) and cpu_gemv.available())
        self._stack: cpu_gemv.DecodeStack | None = None   # built on the first fused decode step
        # The prefill products' path (akv_core.model.prefill); on the bf16 one, prompts attend in bf16 too.
        self.prefill_path: PrefillPath | None = getattr(layers[0].qkv, "prefill_path", None) if layers else None
        self.prefill_attention = self._prefill_attention()
        self.flash_min_rows = FLASH_MIN_ROWS   # the fewest new tokens the fp32 flash attention takes
        # The norms, the MLP's SiLU(gate) * up and RoPE with the K/V write as one C pass over the rows each
        # (`cpu_gemv.rows_prologue`, `cpu_gemv.rotate_and_store`) where every activation is fp32 (the float32
        # prefill path) and the kernels run; else torch's operators.
        self.row_kernels = (self.device.type == "cpu" and self.dtype == torch.float32 and cpu_gemv.available()
                            and (self.prefill_path is None or self.prefill_path.kind == "float32")
                            and config.hidden_size % 16 == 0 and config.intermediate_size % 16 == 0)

    def _prefill_attention(self) -> str:
        """Which kernel a prompt's causal attention runs on: `BF16_BLOCKS` on the bf16 prefill path, `FP32_FLASH`
        on the float32 path of a CPU where `cpu_gemv` runs with fp32 activations, else (or with
        `AKV_PREFILL_ATTENTION=sdpa`) `TORCH_SDPA`."""
        if self.device.type != "cpu" or self.prefill_path is None or attention_switch() == "sdpa":
            return TORCH_SDPA
        if self.prefill_path.kind == "bf16":
            return BF16_BLOCKS
        if (self.prefill_path.kind == "float32" and self.dtype == torch.float32 and self.config.head_dim % 16 == 0
                and self.config.head_dim <= 256 and cpu_gemv.available()):
            return FP32_FLASH
        return TORCH_SDPA

    def _can_fuse_decode(self) -> bool:
        """Whether decode steps can run as five fused CPU kernels per layer (`_decode_fused`): every
        projection on `cpu_gemv` (int8 / int4, or float32's weights as loaded, where this CPU runs it), fp32
        activations, no q/k norms."""
        projections = [p for w in self.layers for p in (w.qkv, w.o, w.gate_up, w.down)]
        return (self.device.type == "cpu" and self.dtype == torch.float32 and self.config.head_dim % 8 == 0
                and all(getattr(p, "fused", False) for p in projections)
                and all(w.q_norm is None and w.o.bias is None and w.down.bias is None for w in self.layers))

    def new_kv_buffers(self, num_slots: int) -> KVBuffers:
        c = self.config
        return KVBuffers(c.num_layers, num_slots, c.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVBuffers) -> Tensor:
        """Write the new tokens' K/V into `kv` and return logits [R, vocab] (fp32)."""
        self._check(batch, kv)
        if self.decodes_fused(batch, kv):
            return self._decode_fused(batch, kv)
        x = self.embed[batch.input_ids].to(self.dtype)
        cos, sin = self.rope.cos_sin(batch.positions)
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        chunks = [self._chunks(seq) for seq in batch.seqs]  # masks are the same in every layer
        kernel = self._kernel_attention(batch, kv, cos, sin)
        masses = ({i: torch.zeros(batch.seqs[i].kv_slots.numel(), dtype=torch.float32, device=self.device)
                   for i in self.mass_probe.seqs} if self.mass_probe is not None and kernel is None else None)
        for index, layer in enumerate(self.layers):
            x = self._block(index, layer, x, cos, sin, batch, kv, chunks if kernel is None else kernel, masses)
        if kernel is not None and kernel.mass is not None:
            self._report_mass(0, batch.seqs, kernel.mass, kernel.offsets)
        for i, weights in (masses or {}).items():
            self.mass_probe.report(i, batch.seqs[i].kv_slots, weights)
        x = rms_norm(x[batch.logits_rows], self.final_norm, self.config.rms_norm_eps)
        return self.lm_head(x).float()

    __call__ = forward

    def _check(self, batch: ForwardBatch, kv: KVBuffers) -> None:
        total = batch.input_ids.numel()
        if batch.positions.numel() != total or batch.out_slots.numel() != total:
            raise ValueError(f"ForwardBatch: input_ids, positions and out_slots must all have {total} entries")
        if sum(seq.q_len for seq in batch.seqs) != total:
            raise ValueError("ForwardBatch: the sequences' q_len must add up to the number of input tokens")
        if kv.num_layers != self.config.num_layers or kv.head_dim != self.config.head_dim:
            raise ValueError("KVBuffers were made for a different model; use model.new_kv_buffers()")

    @property
    def kernel_decode(self) -> bool:
        """Whether decode-only passes run on the C kernels (the fused step on int8, int4 or float32 weights, or
        float32's dense products and attention kernel layer by layer), which split their work over torch's
        thread count."""
        return self.fused_decode or (self._attention_kernel and self.dtype == torch.float32 and all(
            getattr(p, "dense_rows", False) for w in self.layers for p in (w.qkv, w.o, w.gate_up, w.down)))

    def decodes_on_kernels(self, batch: ForwardBatch, kv: KVBuffers) -> bool:
        """Whether `forward(batch, kv)` is a decode-only pass on the C kernels (its thread count:
        akv_core.threads, kernels=True)."""
        return self.kernel_decode and self._decode_only(batch, kv)

    def decodes_fused(self, batch: ForwardBatch, kv: KVBuffers) -> bool:
        """Whether `forward(batch, kv)` runs as one fused C call."""
        return self.fused_decode and self._decode_only(batch, kv)

    def _decode_only(self, batch: ForwardBatch, kv: KVBuffers) -> bool:
        """One new token per sequence, row m of the batch being sequence m's, no mask, no probe."""
        return (self.attention_probe is None and kv.dtype == torch.float32
                and all(seq.q_len == 1 and seq.mask is None and seq.q_start == m for m, seq in enumerate(batch.seqs)))

    def _decode_fused(self, batch: ForwardBatch, kv: KVBuffers) -> Tensor:
        """The decode step in one call through all layers (`cpu_gemv.DecodeStack`: per layer norm + qkv,
        RoPE + K/V write + attention, o into the residual, norm + gate/up, SwiGLU + down into the residual);
        more sequences than a call takes (`cpu_gemv.max_rows()`) go in several calls: each sequence reads only
        its own slots, so a row's result does not depend on the rows beside it."""
        c, eps = self.config, self.config.rms_norm_eps
        if self._stack is None:
            self._stack = cpu_gemv.DecodeStack(
                [cpu_gemv.Layer(w.attn_norm, w.mlp_norm, w.qkv.bias, w.qkv.kernel_weights(), w.o.kernel_weights(),
                                w.gate_up.kernel_weights(), w.down.kernel_weights()) for w in self.layers],
                c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim, eps)
        x = self.embed[batch.input_ids].float()   # a fresh tensor: the residual stream, updated in place
        cos, sin = (t.reshape(len(batch.seqs), -1).contiguous() for t in self.rope.cos_sin(batch.positions))
        most = cpu_gemv.max_rows()
        for start in range(0, len(batch.seqs), most):
            seqs, stop = batch.seqs[start:start + most], min(start + most, len(batch.seqs))
            slots = torch.cat([seq.kv_slots for seq in seqs])
            offsets = torch.tensor([0, *(seq.kv_slots.numel() for seq in seqs)]).cumsum(0)
            mass = None if self.mass_probe is None else cpu_gemv.attention_mass_buffer(c.num_heads, slots)
            self._stack(x[start:stop], cos[start:stop], sin[start:stop], kv.k, kv.v, batch.out_slots[start:stop], slots,
                        offsets, self._scale, mass=mass)
            if mass is not None:
                self._report_mass(start, seqs, mass, offsets)
        rows = x[batch.logits_rows]
        if getattr(self.lm_head, "fused", False):
            prologue = cpu_gemv.Prologue(self.final_norm.float().contiguous(), eps)
            if rows.shape[0] <= most:
                return self.lm_head.product(rows, prologue)
            return torch.cat([self.lm_head.product(rows[i:i + most], prologue) for i in range(0, rows.shape[0], most)])
        return self.lm_head(rms_norm(rows, self.final_norm, eps)).float()

    def _kernel_attention(self, batch: ForwardBatch, kv: KVBuffers, cos: Tensor, sin: Tensor) -> KernelAttention | None:
        """For a decode-only pass on the CPU: the arguments of `cpu_gemv.decode_attention` (RoPE, K/V write and
        attention of every row in one call per layer, instead of one attention call per sequence and layer);
        None where that kernel does not apply (a prompt row, a mask, a probe, q/k norms, not fp32)."""
        if not (self._attention_kernel and self.dtype == torch.float32 and self._decode_only(batch, kv)):
            return None
        rows, slots = len(batch.seqs), torch.cat([seq.kv_slots for seq in batch.seqs])
        mass = None if self.mass_probe is None else cpu_gemv.attention_mass_buffer(self.config.num_heads, slots)
        return KernelAttention(cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous(), slots,
                               torch.tensor([0, *(seq.kv_slots.numel() for seq in batch.seqs)]).cumsum(0), mass)

    def _report_mass(self, first: int, seqs: list[SeqAttention], mass: Tensor, offsets: Tensor) -> None:
        """Hand the wanted sequences' attention weights per slot (summed over heads and layers) to `mass_probe`."""
        for index, (seq, weights) in enumerate(zip(seqs, cpu_gemv.row_masses(mass, self.config.num_heads, offsets))):
            if first + index in self.mass_probe.seqs:
                self.mass_probe.report(first + index, seq.kv_slots, weights)

    def _add_last_row_weights(self, layer: int, q: Tensor, batch: ForwardBatch, kv: KVBuffers,
                              masses: dict[int, Tensor]) -> None:
        """Add to masses[i] the softmax weights of sequence i's last query row over its visible slots (its mask's
        last row, or every slot: a causal chunk's last row sees them all), summed over heads; the layer's new K/V
        are in the pool."""
        for i, total in masses.items():
            seq = batch.seqs[i]
            last = seq.q_start + seq.q_len - 1
            keys = kv.k[layer].index_select(0, seq.kv_slots).transpose(0, 1)                     # [Hkv, K, D]
            weights = self._weights(q[last:last + 1].transpose(0, 1), keys, None if seq.mask is None else seq.mask[-1:])
            total += weights[:, 0].sum(dim=0)

    def _chunks(self, seq: SeqAttention) -> list[tuple[slice, Tensor, Tensor | str | None]]:
        """(query rows, visible slots, mask) per attention call of one sequence; the mask "causal"
        marks a fresh prefill (new tokens only), which SDPA handles block-causally without a mask;
        `BLOCK_CAUSAL` a prompt's new tokens (any prefix) on the prefill path's own kernel, where it has one."""
        if (seq.mask is None and seq.q_len > GEMV_ROWS and self.attention_probe is None
                and (self.prefill_attention == BF16_BLOCKS
                     or (self.prefill_attention == FP32_FLASH and seq.q_len >= self.flash_min_rows))):
            return [(slice(0, seq.q_len), seq.kv_slots, BLOCK_CAUSAL)]
        if seq.mask is None and seq.q_len > 1 and seq.kv_slots.numel() == seq.q_len:
            return [(slice(0, seq.q_len), seq.kv_slots, "causal")]
        if seq.mask is not None or seq.q_len <= PREFILL_CHUNK:
            return [(slice(0, seq.q_len), seq.kv_slots, visibility_mask(seq))]
        prefix = seq.kv_slots.numel() - seq.q_len
        out = []
        for start in range(0, seq.q_len, PREFILL_CHUNK):
            rows = slice(start, min(start + PREFILL_CHUNK, seq.q_len))
            out.append((rows, seq.kv_slots[:prefix + rows.stop], visibility_mask(seq, rows)))
        return out

    def _block(self, index: int, w: LayerWeights, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch,
               kv: KVBuffers, chunks: list | KernelAttention, masses: dict[int, Tensor] | None = None) -> Tensor:
        eps = self.config.rms_norm_eps
        norm = cpu_gemv.rows_prologue if self.row_kernels else rms_norm
        # The residual stream is this pass's own tensor: it is updated in place.
        x = x.add_(self._self_attention(index, w, norm(x, w.attn_norm, eps), cos, sin, batch, kv, chunks, masses))
        if self.row_kernels:
            return x.add_(w.down(cpu_gemv.rows_prologue(w.gate_up(norm(x, w.mlp_norm, eps)), glu=True)))
        gate, up = w.gate_up(rms_norm(x, w.mlp_norm, eps), out_dtype=torch.bfloat16).chunk(2, dim=-1)
        return x.add_(w.down(F.silu(gate, inplace=True).mul_(up)).to(x.dtype))  # bf16 only in a mixed prefill

    def _self_attention(self, index: int, w: LayerWeights, h: Tensor, cos: Tensor, sin: Tensor,
                        batch: ForwardBatch, kv: KVBuffers, chunks: list | KernelAttention,
                        masses: dict[int, Tensor] | None = None) -> Tensor:
        """Project, rotate, write the new K/V into the pool, attend per sequence (or all rows in one kernel
        call: `_kernel_attention`), project back; with `masses`, the wanted last rows' weights added in."""
        c = self.config
        qkv = w.qkv(h)
        if isinstance(chunks, KernelAttention):   # rotation, K/V write and attention in one call
            a = chunks
            return w.o(cpu_gemv.decode_attention(qkv.float().contiguous(), c.num_heads, c.num_kv_heads, a.cos, a.sin,
                                                 kv.k[index], kv.v[index], batch.out_slots, a.slots, a.offsets,
                                                 self._scale, mass=a.mass))
        q, k, v = self._rotate_and_store(index, w, qkv, cos, sin, batch, kv)
        q_size = c.num_heads * c.head_dim
        if masses:
            self._add_last_row_weights(index, q, batch, kv, masses)
        if len(chunks) == 1 and len(chunks[0]) == 1:  # one sequence, one call: no gathering buffer
            _, slots, mask = chunks[0][0]
            return w.o(self._attend_chunk(index, 0, q, k, v, kv, slots, mask).reshape(-1, q_size))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, unlike q (a view of qkv)
        for seq_index, (seq, seq_chunks) in enumerate(zip(batch.seqs, chunks)):
            for rows, slots, mask in seq_chunks:
                lo, hi = seq.q_start + rows.start, seq.q_start + rows.stop
                out[lo:hi] = self._attend_chunk(index, seq_index, q[lo:hi], k[lo:hi], v[lo:hi], kv, slots, mask)
        return w.o(out.view(-1, q_size))

    def _rotate_and_store(self, index: int, w: LayerWeights, qkv: Tensor, cos: Tensor, sin: Tensor,
                          batch: ForwardBatch, kv: KVBuffers) -> tuple[Tensor, Tensor, Tensor]:
        """q, k rotated (after their norms, where the model has them) and v, as [n, heads, D] views, the new K/V
        written into the pool: in one C pass over the rows on the fp32 path where the kernels run (q and k
        rotated in qkv itself), else with torch's operators."""
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if self.row_kernels and self._attention_kernel and kv.dtype == torch.float32:
            qkv, n = qkv.contiguous(), qkv.shape[0]
            cpu_gemv.rotate_and_store(qkv, c.num_heads, c.num_kv_heads, cos.reshape(n, -1).contiguous(),
                                      sin.reshape(n, -1).contiguous(), kv.k[index], kv.v[index], batch.out_slots)
            return (qkv[:, :q_size].view(-1, c.num_heads, c.head_dim),
                    *(qkv[:, start:start + kv_size].view(-1, c.num_kv_heads, c.head_dim)
                      for start in (q_size, q_size + kv_size)))
        v = qkv[:, q_size + kv_size:].view(-1, c.num_kv_heads, c.head_dim)
        if w.q_norm is None:  # q and k are adjacent in qkv: rotate all their heads in one go
            qk = self.rope.rotate(qkv[:, :q_size + kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim),
                                  cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
        else:
            q = rms_norm(qkv[:, :q_size].view(-1, c.num_heads, c.head_dim), w.q_norm, c.rms_norm_eps)
            k = rms_norm(qkv[:, q_size:q_size + kv_size].view(-1, c.num_kv_heads, c.head_dim), w.k_norm,
                         c.rms_norm_eps)
            q, k = self.rope.rotate(q, cos, sin), self.rope.rotate(k, cos, sin)
        kv.k[index].index_copy_(0, batch.out_slots, k.to(kv.dtype))
        kv.v[index].index_copy_(0, batch.out_slots, v.to(kv.dtype))
        return q, k, v

    def _attend_chunk(self, layer: int, seq_index: int, q: Tensor, k: Tensor, v: Tensor, kv: KVBuffers,
                      slots: Tensor, mask: Tensor | str | None) -> Tensor:
        """`attend`, or for a `BLOCK_CAUSAL` chunk the prefill path's blockwise kernel: q and the new k / v are
        the chunk's rows, `slots` every key it sees (the new ones last; a fresh prompt's are k / v themselves)."""
        if not (isinstance(mask, str) and mask == BLOCK_CAUSAL):
            return self.attend(layer, seq_index, q, kv, slots, mask)
        causal = causal_attention_bf16 if self.prefill_attention == BF16_BLOCKS else cpu_gemv.causal_attention
        if slots.numel() == q.shape[0]:
            return causal(q, k, v, self._scale)
        return causal(q, kv.k[layer].index_select(0, slots), kv.v[layer].index_select(0, slots), self._scale)

    def attend(self, layer: int, seq_index: int, q: Tensor, kv: KVBuffers, slots: Tensor,
               mask: Tensor | str | None) -> Tensor:
        """q [n, H, D] against the K/V of `slots`; only the visible slots are ever read."""
        if q.shape[0] == 1 and mask is None and q.device.type == "cuda" and self.attention_probe is None:
            from akv_core.kernels.decode_attention import decode_attention  # Triton: GPU decode steps

            return decode_attention(q[0], kv.k[layer], kv.v[layer], slots, self._scale)[None]
        keys = kv.k[layer].index_select(0, slots).to(q.dtype).transpose(0, 1)   # [Hkv, K, D]
        values = kv.v[layer].index_select(0, slots).to(q.dtype).transpose(0, 1)
        queries = q.transpose(0, 1)                                             # [H, n, D]
        causal = isinstance(mask, str)
        if causal:
            mask = None if self.attention_probe is None else visibility_mask(SeqAttention(0, q.shape[0], slots))
        if self.attention_probe is not None:
            return self._attend_probed(layer, seq_index, queries, keys, values, slots, mask)
        out = F.scaled_dot_product_attention(queries[None], keys[None], values[None], attn_mask=mask,
                                             is_causal=causal, scale=self._scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    def _attend_probed(self, layer: int, seq_index: int, queries: Tensor, keys: Tensor, values: Tensor,
                       slots: Tensor, mask: Tensor | None) -> Tensor:
        """Explicit softmax, so the probe sees the very weights that multiply the values."""
        probs = self._weights(queries, keys, mask)
        self.attention_probe(layer, seq_index, slots, probs.transpose(0, 1))
        group = self.config.num_heads // self.config.num_kv_heads
        return (probs @ values.float().repeat_interleave(group, 0)).to(queries.dtype).transpose(0, 1)

    def _weights(self, queries: Tensor, keys: Tensor, mask: Tensor | None) -> Tensor:
        """Softmax attention weights [H, n, K] (fp32) of queries [H, n, D] over keys [Hkv, K, D], where mask
        [n, K] (True: visible) allows."""
        group = self.config.num_heads // self.config.num_kv_heads
        scores = (queries.float() @ keys.float().repeat_interleave(group, 0).transpose(1, 2)) * self._scale
        if mask is not None:
            scores = scores.masked_fill(~mask[None], float("-inf"))
        return torch.softmax(scores, dim=-1)
