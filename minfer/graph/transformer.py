"""The decoder-only transformer (qwen2 / llama), written against backend ops.

Reads like the math; never branches on device or quantization type.
"""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import MinferError
from .weights import Weights


class Transformer:
    def __init__(self, cfg: ModelConfig, backend, weights: Weights):
        self.cfg, self.be, self.w = cfg, backend, weights
        backend.prepare(weights)

    def forward(self, tokens: np.ndarray, pos0: int, cache, logits_from: int | None = None) -> np.ndarray:
        """tokens int32 (T,) at positions pos0.. -> logits float32 (T - logits_from, vocab).

        logits_from=None computes the LM head for the last position only (prefill);
        0 gives every position (perplexity, teacher forcing).
        """
        cfg, be, w = self.cfg, self.be, self.w
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        T = int(tokens.shape[0])
        if T == 0:
            raise MinferError("empty prompt: nothing to evaluate")
        if pos0 + T > cache.n_ctx:
            raise MinferError(f"{pos0 + T} tokens do not fit the context of {cache.n_ctx}; "
                              f"shorten the prompt or raise the context size")
        with be.guard("running the model"):
            x = be.embed(w.token_embd, tokens)                               # (T, d)
            # the layers' device work, replayed from a CUDA graph when this (T, pos0)
            # comes again for this cache (bench repetitions, perplexity chunks)
            x = be.captured(cache, ("blocks", T, pos0), lambda x: self.blocks(x, pos0, cache), x)
            x = be.rows(x, T - 1 if logits_from is None else logits_from, T)
            logits, = be.norm_linears(x, w.output_norm, cfg.rms_eps, (w.output,), (None,))
            return be.to_numpy(logits)                                       # (n, vocab)

    def forward_batch(self, tokens: np.ndarray, batch, cache) -> np.ndarray:
        """Several sequences in one forward: tokens int32 (T,), the sequences' new
        tokens in the order of batch (a minfer.kv.batch.Batch: each sequence's
        positions and block table in the paged cache `cache`, a new_cache's
        storage) -> logits float32 (len(batch.logit_rows), vocab): each sequence's
        last row, or every row. The linears run once over all T rows; each row
        attends to its own sequence only."""
        cfg, be, w = self.cfg, self.be, self.w
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if tokens.shape != (batch.n_rows,):
            raise ValueError(f"forward_batch: {tokens.shape} tokens for a batch of {batch.n_rows} rows")
        n_blocks = cache.n_ctx // batch.block_tokens              # the storage's blocks
        for i, sp in enumerate(batch.spans):
            # the kernels write through these tables: a block outside the storage would
            # be a write outside it
            if min(sp.table) < 0 or max(sp.table) >= n_blocks:
                raise ValueError(f"forward_batch: sequence {i}'s table names blocks outside the "
                                 f"cache's {n_blocks}")
        with be.guard("running the model"), be.batch_rows(batch):
            x = be.embed(w.token_embd, tokens)                               # (T, d)
            # a decode step's layers replayed from a CUDA graph per batch size (the backend's choice)
            x = be.captured_batch(cache, batch, lambda x: self.blocks(x, batch, cache), x)
            x = be.select_rows(x, batch.logit_rows)                          # (R, d)
            logits, = be.norm_linears(x, w.output_norm, cfg.rms_eps, (w.output,), (None,))
            return be.to_numpy(logits)                                       # (R, vocab)

    def blocks(self, x, pos0, cache):
        """The decoder layers: x (T, d) at positions pos0.. -> (T, d); fills the cache.
        pos0 is an int, or in a decode step whatever position the backend's decode
        hands its step (a position held in device memory on the GPU), or a Batch."""
        be = self.be
        for i, L in enumerate(self.w.layers):
            x = be.attention_block(x, L, cache, i, pos0)                     # x + o(attn)
            x = be.ffn(x, L)                                                 # x + SwiGLU
        return x

    def prefill(self, tokens, cache) -> np.ndarray:
        """Fill the cache from position 0; logits of the last position (vocab,)."""
        return self.forward(tokens, 0, cache)[-1]

    def decode(self, token: int, pos: int, cache) -> np.ndarray:
        """One token at position pos -> logits (vocab,) (teacher forcing, tests)."""
        return self.forward(np.array([token], dtype=np.int32), pos, cache)[-1]

    def decode_greedy(self, token: int, pos: int, cache) -> int:
        """One greedy decode step: token at position pos -> the next token id. The
        argmax is taken on the backend, so only the id comes back; the backend may
        replay the step from a CUDA graph (Backend.decode)."""
        cfg, be, w = self.cfg, self.be, self.w
        if not 0 <= token < cfg.vocab_size:
            raise MinferError(f"token id {token} out of range [0, {cfg.vocab_size})")
        if not 0 <= pos < cache.n_ctx:
            raise MinferError(f"position {pos} does not fit the context of {cache.n_ctx}")

        def step(tokens, p):        # tokens (1,) and position p, as the backend holds them
            x = be.embed(w.token_embd, tokens)                               # (1, d)
            x = self.blocks(x, p, cache)
            logits, = be.norm_linears(x, w.output_norm, cfg.rms_eps, (w.output,), (None,))
            return be.greedy(logits)                                         # [id, finite]

        with be.guard("running the model"):
            nxt, finite = be.decode(cache, step, token, pos)
        if not finite:
            raise MinferError(f"the model produced non-finite logits (NaN or Inf) at position {pos}; "
                              f"its weights may be damaged")
        return nxt
