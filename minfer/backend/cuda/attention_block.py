"""The attention sub-block on the GPU: x + o(attention(RoPE(q), RoPE(k), v)), q, k, v
the projections of rmsnorm(x) * norm_w, in the fewest launches each case allows.

    decode rows (f16 cache; one, or a step's one a sequence)
                                norm -> q8_1 and the q/k/v matvecs; one attention
                                kernel rotates, stores the new K/V row and attends,
                                its combine writing the q8_1 operand of o, whose
                                matvec adds x in its store
    a prompt (f16 cache, q/k/v on the f16 engine)
                                the norm writes the GEMMs' f16 operand; q/k/v as one
                                GEMM; the biases, RoPE, the K/V store and q's
                                rounding in one launch; the flash attention writes
                                o's f16 operand when o takes the f16 engine; o
                                accumulates into x
    otherwise (the f32 cache of other head dims, other engines)
                                the composition of the plain ops

The cache is contiguous or a sequence's view of a paged cache (its block table,
which every kernel here takes), or pos0 is a minfer.kv.batch.Batch: several
sequences' rows, stored at their cache rows, each attending to its own keys
(flash_attn.FlashBatch; the f32 cache: one launch a sequence).
"""
from __future__ import annotations

import numpy as np

from ...errors import MinferError
from ...kv.batch import Batch
from ...kv.blocks import BLOCK_TOKENS
from .kernels import attention as attention_f32
from .kernels import flash_attn
from .kernels.decode_attn import decode_attention, rope_store_kv_f16, store_kv_f16
from .kernels.dequant_f16 import cast_f16
from .kernels.rope import rope
from .launch import DevicePos, cp, out_array, pos_value


class AttentionBlock:
    def __init__(self, cfg, linears, state, settings):
        self.cfg, self.lin, self.state = cfg, linears, state
        self._settings = settings                # () -> the backend's CudaSettings

    def __call__(self, x, L, cache, layer: int, pos0):
        """x (T, d) at positions pos0.. (an int, or a device position in a decode step)
        -> x + o(attention) for layer L's weights; x is consumed."""
        T, cfg, lin = x.shape[0], self.cfg, self.lin
        n_q = cfg.n_head * cfg.head_dim
        qkv = (L.attn_q, L.attn_k, L.attn_v)
        biases = (L.attn_q_bias, L.attn_k_bias, L.attn_v_bias)
        wo, f16_cache = L.attn_output, cache.k.dtype == cp.float16
        step = pos0.decode if isinstance(pos0, Batch) else T == 1       # decode rows, one a sequence
        if f16_cache and step and lin.all_matvec(x, qkv) and lin.path(T, wo).q8_rows \
                and wo.n_in == n_q:
            q, k, v = lin.norm_linears(x, L.attn_norm, cfg.rms_eps, qkv, biases)
            q8 = self._rope_attention_f16(*self._heads(T, q, k, v), cache, layer, pos0,
                                          q8=self.state.q8(0, T, n_q))
            return lin.linear_q8(q8, wo, residual=x)
        # (a decode step on other engines takes the third way: its linears add the
        # biases, and the decode attention rotates, stores and attends each row)
        prompt = T > 1 or (isinstance(pos0, Batch) and pos0.prefill)     # (one prompt row: deterministic mode)
        if prompt and f16_cache and lin.all_f16(x, qkv) and not (isinstance(pos0, Batch) and pos0.decode):
            q, k, v = lin.norm_linears(x, L.attn_norm, cfg.rms_eps, qkv, (None, None, None), views=True)
            o_f16 = lin.path(T, wo).engine == "f16" and wo.n_in == n_q
            a = self._rope_attention_f16(*self._heads(T, q, k, v), cache, layer, pos0,
                                         out=self.state.x16((T, n_q)) if o_f16 else None, biases=biases)
            return lin.linear_f16(a, wo, residual=x) if o_f16 else lin.linear(a, wo, residual=x)
        q, k, v = lin.norm_linears(x, L.attn_norm, cfg.rms_eps, qkv, biases)
        a = self.rope_attention(*self._heads(T, q, k, v), cache, layer, pos0)
        return lin.linear(a, wo, residual=x)

    def _heads(self, T: int, q, k, v) -> tuple:
        """The projections' rows as heads: (T, n_head, hd), (T, n_kv, hd) twice."""
        cfg = self.cfg
        return (q.reshape(T, cfg.n_head, cfg.head_dim), k.reshape(T, cfg.n_head_kv, cfg.head_dim),
                v.reshape(T, cfg.n_head_kv, cfg.head_dim))

    def rope_attention(self, q, k, v, cache, layer: int, pos0, out=None):
        """The f16 cache (head dim 128): _rope_attention_f16. The f32 cache: rope,
        rope, attention."""
        if cache.k.dtype != cp.float16:
            return self.attention(self.rope(q, pos0), self.rope(k, pos0), v, cache, layer, pos0, out=out)
        return self._rope_attention_f16(q, k, v, cache, layer, pos0, out=out)

    def _rope_attention_f16(self, q, k, v, cache, layer: int, pos0, out=None, biases=(None, None, None),
                            q8=None):
        """One decode row rotates, stores and attends in one kernel (and its combine
        writes the q8_1 form of the output into q8 when given); a prompt (or a Batch)
        runs the biases, RoPE, the KV store and q's rounding to f16 in one launch,
        then the flash attention. A decode row takes no biases (its matvecs add them);
        neither do a decode step's rows, which attend each alone (q8: of B rows)."""
        self._check_heads(q, k)
        self._rope_check(q, pos0)
        kc, vc, cos_sin = cache.k[layer], cache.v[layer], self.state.cos_sin
        wgmma = self._settings().flash_wgmma
        if isinstance(pos0, Batch) and pos0.decode and not any(b is not None for b in biases):
            dev = self._decode_device(pos0)     # B decode rows: each rotates, stores and attends alone
            return decode_attention(q, kc, vc, dev["pos"], out, new_kv=(k, v), cos_sin=cos_sin,
                                    neox=self.cfg.rope_neox, q8=q8, tab=dev["tables"],
                                    n_ctx=dev["tables"].shape[1] * BLOCK_TOKENS)
        if isinstance(pos0, Batch):
            dev = self._device(pos0)
            q16 = rope_store_kv_f16(q, k, v, kc, vc, cos_sin, 0, self.cfg.rope_neox,
                                    q_out=cp.empty(q.shape, cp.float16), biases=biases, rows=dev["rows"])
            return flash_attn.flash_attention(q16, kc, vc, 0, out=out, wgmma=wgmma, batch=dev["flash"])
        span = {"tab": cache.table, "n_ctx": cache.n_ctx}
        if q.shape[0] == 1:
            if any(b is not None for b in biases):
                raise ValueError("decode attention: the q/k/v biases belong to the matvecs")
            return decode_attention(q, kc, vc, pos0, out, new_kv=(k, v), cos_sin=cos_sin,
                                    neox=self.cfg.rope_neox, q8=q8, **span)
        q16 = rope_store_kv_f16(q, k, v, kc, vc, cos_sin, pos0, self.cfg.rope_neox,
                                q_out=cp.empty(q.shape, cp.float16), biases=biases, **span)
        return flash_attn.flash_attention(q16, kc, vc, pos_value(pos0), out=out, wgmma=wgmma, **span)

    def _device(self, batch: Batch) -> dict:
        """A Batch's device copies, made on first use and shared by the layers: its rows
        (position, cache row) and its flash layout."""
        dev, cfg = batch.device, self.cfg
        if "rows" not in dev:
            dev["rows"] = cp.asarray(batch.rows)                                  # (T, 2) int32
            dev["flash"] = flash_attn.FlashBatch(
                [(int(batch.starts[i]), sp.n, sp.pos0, sp.table) for i, sp in enumerate(batch.spans)],
                cfg.n_head, cfg.n_head_kv)
        return dev

    def _decode_device(self, batch: Batch) -> dict:
        """A decode step's positions (a DevicePos of B) and block tables (B, blocks):
        made here, or bound beforehand to the fixed buffers a captured step reads
        (CUDABackend.captured_batch)."""
        dev = batch.device
        if "pos" not in dev:
            positions = np.ascontiguousarray(batch.positions)                     # (B,) int32
            dev["pos"] = DevicePos(batch.max_pos, cp.asarray(positions))
            dev["tables"] = cp.asarray(batch.table_matrix())                     # (B, blocks) int32
        return dev

    def attention(self, q, k, v, cache, layer: int, pos0: int, out=None):
        """Store k/v at pos0.. and attend (the backend's plain op); a Batch: the f16
        cache as _rope_attention_f16's store and flash attention (q, k already
        rotated), the f32 cache one sequence at a time."""
        self._check_heads(q, k)
        kc, vc = cache.k[layer], cache.v[layer]
        if isinstance(pos0, Batch):
            dev = self._device(pos0)
            if cache.k.dtype == cp.float16:
                store_kv_f16(k, v, kc, vc, 0, rows=dev["rows"])
                q16 = cast_f16(q, cp.empty(q.shape, cp.float16))
                return flash_attn.flash_attention(q16, kc, vc, 0, out=out, wgmma=self._settings().flash_wgmma,
                                                  batch=dev["flash"])
            y = out_array(out, (q.shape[0], q.shape[1] * q.shape[2]), "attention out")
            for i, sp in enumerate(pos0.spans):
                r = pos0.seq_rows(i)
                attention_f32.attention_f32(q[r], k[r], v[r], kc, vc, sp.pos0, out=y[r],
                                            tab=cp.asarray(list(sp.table), cp.int32))
            return y
        span = {"tab": cache.table, "n_ctx": cache.n_ctx}
        if cache.k.dtype == cp.float16:          # head dim 128: tensor-core flash attention
            wgmma = self._settings().flash_wgmma if q.shape[0] > 1 else True
            return flash_attn.attention_f16(q, k, v, kc, vc, pos0, out=out, wgmma=wgmma, **span)
        return attention_f32.attention_f32(q, k, v, kc, vc, pos0, out=out, **span)

    def rope(self, x, pos0, out=None):
        self._rope_check(x, pos0)
        if isinstance(pos0, Batch):
            return rope(x, self.state.cos_sin, 0, self.cfg.rope_neox, out=out, rows=self._device(pos0)["rows"])
        return rope(x, self.state.cos_sin, pos0, self.cfg.rope_neox, out=out)

    def _rope_check(self, x, pos0) -> None:
        last = pos0.max_pos if isinstance(pos0, Batch) else pos_value(pos0) + x.shape[0] - 1
        end, table = last + 1, self.state.cos_sin
        if table is None or end > table.shape[0]:
            raise MinferError(f"RoPE positions up to {end} exceed the "
                              f"{0 if table is None else table.shape[0]} positions prepared by new_cache")
        if x.shape[-1] != self.cfg.head_dim:
            raise ValueError(f"rope: head dim {x.shape[-1]}, model has {self.cfg.head_dim}")

    def _check_heads(self, q, k) -> None:
        cfg = self.cfg
        if q.shape[1:] != (cfg.n_head, cfg.head_dim) or k.shape[1:] != (cfg.n_head_kv, cfg.head_dim):
            raise ValueError(f"attention: q {q.shape}, k {k.shape} do not match the model's heads")
