"""One loaded model: file, config, tokenizer, backend, weights and graph, built in order
(docs/DESIGN.md, data flow). The CLI, tests and benchmarks all start here."""
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
class ModelFile:
    """The parts of a model that need no weights: enough to tokenize and to check a
    prompt before paying for the weight load."""
    gf: Any                 # minfer.gguf.GGUFFile
    cfg: ModelConfig
    tokenizer: Any          # minfer.tokenizer.Tokenizer
    n_ctx: int

    @classmethod
    def open(cls, path, n_ctx: int | None = None) -> "ModelFile":
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
        return cls(gf=gf, cfg=cfg, tokenizer=Tokenizer.from_gguf(gf), n_ctx=n_ctx)


@dataclass
class Engine:
    gf: Any                 # minfer.gguf.GGUFFile
    cfg: ModelConfig
    tokenizer: Any          # minfer.tokenizer.Tokenizer
    backend: Backend
    weights: Weights
    model: Transformer
    n_ctx: int              # default context of new_cache()

    @classmethod
    def load(cls, path, backend: str = "cpu", n_ctx: int | None = None, progress: bool = True) -> "Engine":
        return cls.from_file(ModelFile.open(path, n_ctx), backend, progress)

    @classmethod
    def from_file(cls, mf: ModelFile, backend: str = "cpu", progress: bool = True) -> "Engine":
        be = get_backend(backend, mf.cfg)
        with be.guard("loading the weights"):
            weights = load_weights(mf.gf, mf.cfg, be, progress=progress)
        return cls(gf=mf.gf, cfg=mf.cfg, tokenizer=mf.tokenizer, backend=be, weights=weights,
                   model=Transformer(mf.cfg, be, weights), n_ctx=mf.n_ctx)

    def new_cache(self, n_ctx: int | None = None):
        """An empty KV cache for n_ctx positions (default: the engine's context)."""
        return self.backend.new_cache(n_ctx or self.n_ctx)
