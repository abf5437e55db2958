"""ModelConfig.from_gguf: hyperparameters from metadata keys, per architecture."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

from minfer.config import ModelConfig
from minfer.errors import MinferError
from minfer.format.gguf import open_gguf


def test_7b_header_config(header_7b):
    # expected values: models/README.md (the DeepSeek-R1-Distill-Qwen-7B card)
    cfg = ModelConfig.from_gguf(open_gguf(header_7b, header_only=True))
    assert cfg.arch == "qwen2"
    assert (cfg.n_layer, cfg.d_model, cfg.d_ff) == (28, 3584, 18944)
    assert (cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rep) == (28, 4, 128, 7)
    assert cfg.kv_dim == 512
    assert cfg.vocab_size == 152064
    assert cfg.rope_base == 10000.0
    assert cfg.rms_eps == float(np.float32(1e-6))    # stored as float32 in the file
    assert cfg.qkv_bias and cfg.rope_neox


def _tiny(tmp_path, arch="llama", name="tiny.gguf", skip=(), vocab=11, d=24, heads=(6, 2)):
    """A small file written by gguf.GGUFWriter with `arch`'s hyperparameter keys."""
    rng = np.random.default_rng(len(name) + d)
    w = GGUFWriter(tmp_path / name, arch)
    keys = {
        "block_count": (w.add_block_count, 3),
        "embedding_length": (w.add_embedding_length, d),
        "feed_forward_length": (w.add_feed_forward_length, 40),
        "head_count": (w.add_head_count, heads[0]),
        "head_count_kv": (w.add_head_count_kv, heads[1]),
        "context_length": (w.add_context_length, 96),
        "rope_freq_base": (w.add_rope_freq_base, 500000.0),
        "rms_eps": (w.add_layer_norm_rms_eps, 1e-5),
    }
    for k, (add, v) in keys.items():
        if k not in skip:
            add(v)
    w.add_token_list([f"t{i}" for i in range(vocab + 3)])   # the embedding table wins
    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, d)) + 0.5).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_gguf(tmp_path / name)


def test_tiny_llama_config(tmp_path):
    cfg = ModelConfig.from_gguf(_tiny(tmp_path))
    assert cfg.arch == "llama"
    assert (cfg.n_layer, cfg.d_model, cfg.d_ff, cfg.n_ctx_train) == (3, 24, 40, 96)
    assert (cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rep, cfg.kv_dim) == (6, 2, 4, 3, 8)
    assert cfg.vocab_size == 11
    assert cfg.rope_base == 500000.0
    assert cfg.rms_eps == float(np.float32(1e-5))
    assert not cfg.qkv_bias and not cfg.rope_neox


def test_unsupported_architecture(tmp_path):
    gf = _tiny(tmp_path, arch="gpt2")
    with pytest.raises(MinferError, match="gpt2"):
        ModelConfig.from_gguf(gf)


def test_missing_key(tmp_path):
    gf = _tiny(tmp_path, skip=("block_count",))
    with pytest.raises(MinferError, match="llama.block_count"):
        ModelConfig.from_gguf(gf)


def test_inconsistent_heads(tmp_path):
    gf = _tiny(tmp_path, heads=(6, 4))        # 6 query heads cannot share 4 KV heads
    with pytest.raises(MinferError, match="head"):
        ModelConfig.from_gguf(gf)
