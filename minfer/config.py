"""Model hyperparameters, built in one place from GGUF metadata keys."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import Keys

from .contract import hyperparameters, show_value
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
        """Every value type- and range-checked by the contract (minfer/contract.py); the
        architecture decides the rest."""
        arch = gf.get(Keys.General.ARCHITECTURE)
        if arch not in SUPPORTED_ARCHS:
            raise MinferError(f"{gf.path}: unsupported architecture {show_value(arch)} "
                              f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        return cls(arch=arch, **hyperparameters(gf, arch),
                   qkv_bias=(arch == "qwen2"), rope_neox=(arch == "qwen2"))
