"""One loaded model: file, config, tokenizer, backend, weights and graph, built in order
(docs/DESIGN.md, data flow). The CLI, tests and benchmarks all start here."""
from __future__ import annotations

import numbers
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
MAX_CTX = 2**31 - 1         # positions are int32 on the device; memory bounds it far sooner


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
        """Map the file and check the model contract (minfer/contract.py) before the
        tokenizer is built or anything large is allocated."""
        from .contract import check_model
        from .gguf import open_gguf
        from .tokenizer import Tokenizer

        path = Path(path)
        if not path.exists():
            raise MinferError(f"{path}: no such model file")
        if not path.is_file():
            raise MinferError(f"{path}: not a regular file")
        gf = open_gguf(str(path))
        try:
            cfg = ModelConfig.from_gguf(gf)
            check_model(gf, cfg)
            if n_ctx is None:
                n_ctx = min(cfg.n_ctx_train, DEFAULT_MAX_CTX)
            if isinstance(n_ctx, bool) or not isinstance(n_ctx, numbers.Integral) \
                    or not 1 <= n_ctx <= MAX_CTX:
                raise MinferError(f"context size must be between 1 and {MAX_CTX}, got {n_ctx!r}")
            return cls(gf=gf, cfg=cfg, tokenizer=Tokenizer.from_gguf(gf), n_ctx=int(n_ctx))
        except BaseException:
            gf.close()              # a rejected file keeps no mapping open
            raise


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
        # Backends copy what they need at load, so the mapping can go: a file
        # truncated or replaced underneath cannot fault a later step (SIGBUS).
        # gf keeps its metadata and tensor table; gf.raw() now raises.
        if not mf.gf.close():
            raise RuntimeError(f"the {be.name} backend kept a view of the mapped model file "
                               f"after load; it must copy what it needs")
        return cls(gf=mf.gf, cfg=mf.cfg, tokenizer=mf.tokenizer, backend=be, weights=weights,
                   model=Transformer(mf.cfg, be, weights), n_ctx=mf.n_ctx)

    def new_cache(self, n_ctx: int | None = None):
        """An empty KV cache for n_ctx positions (default: the engine's context)."""
        return self.backend.new_cache(n_ctx or self.n_ctx)
