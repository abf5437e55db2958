"""NumPy quantization formats: dequantizers equal bit for bit to gguf.quants,
the reference k-quant quantizers (Q4_K, Q6_K) used for synthetic models, and the
q6_K padding and W_exp expansion of the seed (seed/000 §2.3, §3.2).

INTERFACE (implemented by the quants work; other modules rely on exactly this):

    QK_K = 256
    Q6K_BLOCK = 210         # ql[128] + qh[64] + scales[16] + d (f16)
    Q6K_PADDED = 224        # padded stride: 16-byte aligned super-blocks

    SUPPORTED: frozenset of GGMLQuantizationType (F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K)
    dequantize(raw: np.ndarray uint8 (rows, row_bytes) or flat, qtype, shape) -> float32 ndarray of `shape`
    dequantize_rows(raw (rows, row_bytes) uint8, qtype, n_cols) -> float32 (rows, n_cols)
    quantize(x: float32 (rows, cols), qtype) -> uint8 (rows, row_bytes)    # Q4_K, Q6_K, Q8_0, F16, F32
    pad_q6k(raw: uint8 (rows, nb*210)) -> uint8 (rows, nb*224)             # zero-filled padding
    expand_q6k_dense(padded: uint8 (rows, nb*224) or flat, od, id) -> int8 (od, id)
        # W_exp: (ql | qh<<4) - 32 per element, row stride id, super-block stride 256
"""
