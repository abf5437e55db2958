"""One loaded model: file, config, tokenizer, backend, weights and graph, built in order
(DESIGN.md data flow). The CLI, tests and benchmarks all start here."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backend import get_backend
from .backend.base import Backend
from .config import ModelConfig
from .errors import MinferError
from .graph.transformer import Transformer
from .graph.weights import Weights, load_weights

DEFAULT_MAX_CTX = 4096      # default context: the model's training context, capped here


@dataclass
class Engine:
    gf: Any                 # minfer.gguf.GGUFFile
    cfg: ModelConfig
    tokenizer: Any          # minfer.tokenizer.Tokenizer
    backend: Backend
    weights: Weights
    model: Transformer
    n_ctx: int

    @classmethod
    def load(cls, path, backend: str = "cpu", n_ctx: int | None = None, progress: bool = True) -> "Engine":
        from .gguf import open_gguf
        from .tokenizer import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise MinferError(f"{path}: no such model file")
        gf = open_gguf(str(path))
        cfg = ModelConfig.from_gguf(gf)
        if n_ctx is None:
            n_ctx = min(cfg.n_ctx_train, DEFAULT_MAX_CTX)
        if n_ctx < 1:
            raise MinferError(f"context size must be at least 1, got {n_ctx}")
        tokenizer = Tokenizer.from_gguf(gf)
        be = get_backend(backend, cfg)
        weights = load_weights(gf, cfg, be, progress=progress)
        return cls(gf=gf, cfg=cfg, tokenizer=tokenizer, backend=be, weights=weights,
                   model=Transformer(cfg, be, weights), n_ctx=n_ctx)

    def new_cache(self, n_ctx: int | None = None):
        """An empty KV cache for n_ctx positions (default: the engine's context)."""
        return self.backend.new_cache(n_ctx or self.n_ctx)
