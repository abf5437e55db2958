"""Model hyperparameters, built in one place from GGUF metadata keys."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import Keys

from .errors import MinferError

SUPPORTED_ARCHS = ("qwen2", "llama")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_head_kv: int
    d_ff: int
    vocab_size: int
    n_ctx_train: int
    rope_base: float
    rms_eps: float
    # qwen2: q/k/v carry a bias, RoPE rotates the two halves of a head (NeoX).
    # llama: no bias; its GGUF q/k weights are permuted so that RoPE rotates
    # adjacent pairs (ggml's "normal" mode). See graph.weights.load_weights.
    qkv_bias: bool
    rope_neox: bool

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_head // self.n_head_kv

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @classmethod
    def from_gguf(cls, gf) -> "ModelConfig":
        arch = gf.get(Keys.General.ARCHITECTURE)
        if arch not in SUPPORTED_ARCHS:
            raise MinferError(
                f"{gf.path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

        def key(fmt: str, default=None, required=True):
            k = fmt.format(arch=arch)
            v = gf.get(k, default)
            if v is None and required:
                raise MinferError(f"{gf.path}: missing metadata key {k}")
            return v

        n_head = int(key(Keys.Attention.HEAD_COUNT))
        d_model = int(key(Keys.LLM.EMBEDDING_LENGTH))
        tokens = gf.get(Keys.Tokenizer.LIST)
        vocab = int(key(Keys.LLM.VOCAB_SIZE, default=len(tokens) if tokens else None))
        if "token_embd.weight" in gf.tensors:
            # the embedding table is the ground truth for the vocabulary size
            vocab = gf.tensors["token_embd.weight"].shape[0]
        cfg = cls(
            arch=arch,
            n_layer=int(key(Keys.LLM.BLOCK_COUNT)),
            d_model=d_model,
            n_head=n_head,
            n_head_kv=int(key(Keys.Attention.HEAD_COUNT_KV, default=n_head)),
            d_ff=int(key(Keys.LLM.FEED_FORWARD_LENGTH)),
            vocab_size=vocab,
            n_ctx_train=int(key(Keys.LLM.CONTEXT_LENGTH, default=2048)),
            rope_base=float(key(Keys.Rope.FREQ_BASE, default=10000.0)),
            rms_eps=float(key(Keys.Attention.LAYERNORM_RMS_EPS, default=1e-5)),
            qkv_bias=(arch == "qwen2"),
            rope_neox=(arch == "qwen2"),
        )
        if d_model % n_head or n_head % cfg.n_head_kv or cfg.head_dim % 2:
            raise MinferError(f"{gf.path}: inconsistent head geometry "
                              f"(d_model {d_model}, heads {n_head}/{cfg.n_head_kv})")
        return cfg
