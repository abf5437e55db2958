// Dequantize selected rows (the embedding lookup): W (rows, row_bytes), tok (T,)
// int32 -> y (T, n) f32, y[t] = dequant(W[tok[t]]). Bit-identical to
// minfer.format.quants.dequantize_rows (= gguf.quants): the same f32 operations in the
// same order, each rounded on its own (__fmul_rn/__fsub_rn forbid FMA contraction).
// Grid (ceil(n/THREADS_1D), T), one thread per output element.
#include "common.cuh"

// The arguments of a rows kernel: W as stored (rows of WT), the token ids, y (T, n)
#define ROWS_ARGS(WT) const WT* __restrict__ W, const int* __restrict__ tok, float* __restrict__ y, int n
// This thread's row t (blockIdx.y) and element e of it; threads past the row's end return
#define ROWS_ELEMENT(t, e)                                                            \
    const int t = blockIdx.y, e = blockIdx.x * THREADS_1D + threadIdx.x;            \
    if (e >= n) return

// q4_K (144-byte blocks as stored): (d*sc) * q - (dmin*m)
extern "C" __global__ void __launch_bounds__(THREADS_1D)
dequant_rows_q4k(ROWS_ARGS(u8)) {
    GRID_DEPENDENCY();
    ROWS_ELEMENT(t, e);
    const u8* blk = W + (size_t)tok[t] * (n / QK_K) * Q4K_BYTES + (size_t)(e / QK_K) * Q4K_BYTES;
    const int r = e % QK_K, j = r / 32, l = r % 32;
    int sc, m;
    q4k_scale_min(j, blk + 4, &sc, &m);
    const float q = (float)((blk[Q4K_QS + 32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF);
    const float dsc = __fmul_rn(load_f16(blk), (float)sc);
    const float dm = __fmul_rn(load_f16(blk + 2), (float)m);
    y[(size_t)t * n + e] = __fsub_rn(__fmul_rn(dsc, q), dm);
}

// q6_K (padded 224-byte stride): (d*sc) * ((ql | qh<<4) - 32)
extern "C" __global__ void __launch_bounds__(THREADS_1D)
dequant_rows_q6k(ROWS_ARGS(u8)) {
    GRID_DEPENDENCY();
    ROWS_ELEMENT(t, e);
    const u8* blk = W + (size_t)tok[t] * (n / QK_K) * Q6K_PADDED + (size_t)(e / QK_K) * Q6K_PADDED;
    const int r = e % QK_K, h = r / 128, q = (r / 32) % 4, l = r % 32;
    const int v = ((blk[64 * h + 32 * (q % 2) + l] >> (4 * (q / 2))) & 0xF) |
                  (((blk[Q6K_QH + 32 * h + l] >> (2 * q)) & 3) << 4);
    const float dsc = __fmul_rn(load_f16(blk + Q6K_D), (float)(i8)blk[Q6K_SC + r / 16]);
    y[(size_t)t * n + e] = __fmul_rn(dsc, (float)(v - 32));
}

// q8_0 (34-byte blocks): q * d
extern "C" __global__ void __launch_bounds__(THREADS_1D)
dequant_rows_q8_0(ROWS_ARGS(u8)) {
    GRID_DEPENDENCY();
    ROWS_ELEMENT(t, e);
    const u8* blk = W + (size_t)tok[t] * (n / 32) * Q8_0_BYTES + (size_t)(e / 32) * Q8_0_BYTES;
    y[(size_t)t * n + e] = __fmul_rn((float)(i8)blk[2 + e % 32], load_f16(blk));
}

// f16 -> f32 (exact)
extern "C" __global__ void __launch_bounds__(THREADS_1D)
dequant_rows_f16(ROWS_ARGS(u16)) {
    GRID_DEPENDENCY();
    ROWS_ELEMENT(t, e);
    y[(size_t)t * n + e] = f16_to_f32(W[(size_t)tok[t] * n + e]);
}

// f32 row copy
extern "C" __global__ void __launch_bounds__(THREADS_1D)
dequant_rows_f32(ROWS_ARGS(float)) {
    GRID_DEPENDENCY();
    ROWS_ELEMENT(t, e);
    y[(size_t)t * n + e] = W[(size_t)tok[t] * n + e];
}
