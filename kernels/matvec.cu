// M=1 (decode) matrix-vector kernels on quantized weights, with x given as q8_1
// blocks of 32 (quantize.cu: int8 q, scale d_a, sum s_a = d_a*sum(q)), as
// ggml-cuda's mul_mat_vec_q does: the dot of a weight slice with x is an integer
// dot (dp4a, four int8 products per instruction) rescaled once per sub-block.
// With x in f32 every weight element cost a nibble extraction, a conversion and
// an FMA, and the kernels were bound by those instructions at about a third of
// the memory bandwidth.
//
// One row-dot routine per format (dot_q4k, dot_q6k, dot_q32) takes R weight rows
// and adds each lane's share of row . x to acc[R]; the lanes' partial sums meet in
// a warp reduction. One kernel, templated on two ggml type ids (Q4_K 12, q6_K 14
// padded, and the 32-element group types of q32_decode.cuh) that its weights take:
//   matvec  y_s (od_s,) = W_s (od_s, K) @ x [+ bias_s] [+ res_s] for up to three
//           weights that read the same x (q/k/v, gate/up in one launch), R rows
//           per warp or per block (split: a block's warps share its rows, each
//           taking part of K), MV_WARPS warps per block, the blocks of the weights
//           one after the other in the grid; res is the residual stream (y may
//           alias it). R (2 or 4 = MV_RPW) is the launch's choice (matvec.py,
//           measured per shape: 2 for a split q6_K weight, whose 4-row loop is
//           held at the 80-register cap); a row's sums do not depend on it, so
//           every R gives the same bits.
// Weights are read through the non-coherent cache (__ldg): the weight pointer is
// picked per block, so __restrict__ alone no longer tells the compiler.
// MV_MIN_BLOCKS resident blocks per SM cap the registers at 80: the q6_K kernel
// otherwise took 84, which the allocation granule rounds to 88, so only five
// blocks fit; with six the 7B's q6_K ffn_down went from 51 to 27 us
// (scripts/bench/decode_breakdown.py re-measures the matvecs).
// Rows past od are clamped to the last row (computed, never written), so the loop
// bodies have no branch between their loads. A row's arithmetic depends only on
// the split, which the wrapper picks from the weight's own row count (few rows:
// split, so the grid still fills the GPU), so one weight per launch or three give
// the same bits.
#include "q32_decode.cuh"

#define QT_Q4K 12
#define QT_Q6K 14

// word k (0..3) of a 16-byte vector, selected in registers (an indexed local array
// would live in stack memory)
__device__ __forceinline__ u32 word_of(uint4 v, int k) {
    return k < 2 ? (k == 0 ? v.x : v.y) : (k == 2 ? v.z : v.w);
}

// sum of the byte-wise products of a (4 words) and b (4 words), int8 x int8
__device__ __forceinline__ int dot16_s8(const u32 a[4], uint4 b) {
    int s = __dp4a((int)a[0], (int)b.x, 0);
    s = __dp4a((int)a[1], (int)b.y, s);
    s = __dp4a((int)a[2], (int)b.z, s);
    return __dp4a((int)a[3], (int)b.w, s);
}

// ggml get_scale_min_k4 of sub-blocks j and j+1 (j even, 0..6) from the 12 packed
// scale bytes held as words s0 = bytes 0..3, s1 = 4..7, s2 = 8..11
__device__ __forceinline__ void q4k_scales2(int j, u32 s0, u32 s1, u32 s2, int sc[2], int m[2]) {
#pragma unroll
    for (int u = 0; u < 2; ++u) q4k_scale_min_words(s0, s1, s2, j + u, sc[u], m[u]);
}

// device bytes of one weight row of K elements
template <int QT>
__device__ __forceinline__ size_t row_bytes(int K) {
    if constexpr (QT == QT_Q4K) return (size_t)(K / QK_K) * Q4K_BYTES;
    else if constexpr (QT == QT_Q6K) return (size_t)(K / QK_K) * Q6K_PADDED;
    else return (size_t)(K / 32 / Fmt<QT>::G) * Fmt<QT>::BYTES;
}

// q4_K rows as stored (144-byte blocks). Lane slice c (0..7) = qs[16c .. 16c+15]:
// chunk i = c/2 of 32 bytes holds elements l0..l0+15 (l0 = 16*(c%2)) of sub-block
// 2i (low nibbles) and of sub-block 2i+1 (high nibbles). Per sub-block j:
//   acc += d*sc_j * d_a * sum(q*xq) - dmin*m_j * s_a
// the min term once per sub-block (by the l0 == 0 lane). The block's first 16 bytes
// (d, dmin, scales) come in as one uint4.
template <int R, int NB>
__device__ __forceinline__ void dot_q4k(const u8* const (&rows)[R], const i8* __restrict__ xq,
                                        const float* __restrict__ xd, const float* __restrict__ xs,
                                        int K, int lane, int kw, int nkw, float (&acc)[R][NB]) {
    const int nb = K / QK_K;
    const int c = lane % 8, i = c / 2, l0 = (c % 2) * 16;
    const float first = l0 == 0 ? 1.0f : 0.0f;          // this lane adds the min terms
    for (int b = lane / 8 + 4 * kw; b < nb; b += 4 * nkw) {
        uint4 hd[R], q[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u8* blk = rows[r] + (size_t)b * Q4K_BYTES;
            hd[r] = __ldg((const uint4*)blk);
            q[r] = __ldg((const uint4*)(blk + Q4K_QS + 16 * c));
        }
        const int e0 = b * QK_K + 64 * i + l0, g0 = b * (QK_K / QK8_1) + 2 * i;
        if constexpr (NB == 1) {
            const uint4 xa = *(const uint4*)(xq + e0), xb = *(const uint4*)(xq + e0 + 32);
            const float da0 = xd[g0], da1 = xd[g0 + 1], sa0 = first * xs[g0], sa1 = first * xs[g0 + 1];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const u32 lo[4] = {q[r].x & 0x0F0F0F0Fu, q[r].y & 0x0F0F0F0Fu,
                                   q[r].z & 0x0F0F0F0Fu, q[r].w & 0x0F0F0F0Fu};
                const u32 hi[4] = {(q[r].x >> 4) & 0x0F0F0F0Fu, (q[r].y >> 4) & 0x0F0F0F0Fu,
                                   (q[r].z >> 4) & 0x0F0F0F0Fu, (q[r].w >> 4) & 0x0F0F0F0Fu};
                int sc[2], m[2];
                q4k_scales2(2 * i, hd[r].y, hd[r].z, hd[r].w, sc, m);
                const float d = f16_to_f32((u16)(hd[r].x & 0xFFFF)), dmin = f16_to_f32((u16)(hd[r].x >> 16));
                acc[r][0] += d * (float)sc[0] * da0 * (float)dot16_s8(lo, xa) - dmin * (float)m[0] * sa0;
                acc[r][0] += d * (float)sc[1] * da1 * (float)dot16_s8(hi, xb) - dmin * (float)m[1] * sa1;
            }
            continue;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u32 lo[4] = {q[r].x & 0x0F0F0F0Fu, q[r].y & 0x0F0F0F0Fu,
                               q[r].z & 0x0F0F0F0Fu, q[r].w & 0x0F0F0F0Fu};
            const u32 hi[4] = {(q[r].x >> 4) & 0x0F0F0F0Fu, (q[r].y >> 4) & 0x0F0F0F0Fu,
                               (q[r].z >> 4) & 0x0F0F0F0Fu, (q[r].w >> 4) & 0x0F0F0F0Fu};
            int sc[2], m[2];
            q4k_scales2(2 * i, hd[r].y, hd[r].z, hd[r].w, sc, m);
            const float d = f16_to_f32((u16)(hd[r].x & 0xFFFF)), dmin = f16_to_f32((u16)(hd[r].x >> 16));
#pragma unroll
            for (int v = 0; v < NB; ++v) {                   // x row v: the same sums as alone
                const i8* xv = xq + (size_t)v * K;
                const float* dv = xd + (size_t)v * (K / QK8_1);
                const float* sv = xs + (size_t)v * (K / QK8_1);
                const uint4 xa = *(const uint4*)(xv + e0), xb = *(const uint4*)(xv + e0 + 32);
                const float da0 = dv[g0], da1 = dv[g0 + 1], sa0 = first * sv[g0], sa1 = first * sv[g0 + 1];
                acc[r][v] += d * (float)sc[0] * da0 * (float)dot16_s8(lo, xa) - dmin * (float)m[0] * sa0;
                acc[r][v] += d * (float)sc[1] * da1 * (float)dot16_s8(hi, xb) - dmin * (float)m[1] * sa1;
            }
        }
    }
}

// q6_K rows padded (224-byte stride). Lane slice c (0..7) = ql[16c .. 16c+15]: half
// h = c/4, m = (c/2)%2, l0 = 16*(c%2); the low nibbles are quarter q=m, the high
// ones q=m+2 (elements 128h + 32q + l0 + e), with the 2-bit field 2q of
// qh[32h + l0 + e] on top: u = ql_nibble | qh_bits << 4 in 0..63 (a non-negative
// int8), and the weight is u - 32, so per 16-element sub-block
//   acc += d*sc * d_a * (sum(u*xq) - 32*sum(xq))
// with sum(xq) formed once per slice for all rows. ql, qh and the 16 scales come in
// as uint4s, d as one 16-bit load. (The sums xs are not needed.)
template <int R, int NB>
__device__ __forceinline__ void dot_q6k(const u8* const (&rows)[R], const i8* __restrict__ xq,
                                        const float* __restrict__ xd, int K, int lane, int kw, int nkw,
                                        float (&acc)[R][NB]) {
    const int nb = K / QK_K;
    const int c = lane % 8, h = c / 4, m = (c / 2) % 2, l0 = (c % 2) * 16;
    const u32 ones[4] = {0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u};
    for (int b = lane / 8 + 4 * kw; b < nb; b += 4 * nkw) {
        uint4 ql[R], qh[R], sc[R];
        u16 dh[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u8* blk = rows[r] + (size_t)b * Q6K_PADDED;
            ql[r] = __ldg((const uint4*)(blk + 16 * c));
            qh[r] = __ldg((const uint4*)(blk + Q6K_QH + 32 * h + l0));
            sc[r] = __ldg((const uint4*)(blk + Q6K_SC));
            dh[r] = __ldg((const u16*)(blk + Q6K_D));
        }
#pragma unroll
        for (int v = 0; v < NB; ++v) {                       // x row v: the same sums as alone
            uint4 xv[2];
            float da[2], off[2];
#pragma unroll
            for (int k = 0; k < 2; ++k) {                     // k=0: low nibbles, k=1: high
                const int q = m + 2 * k;
                xv[k] = *(const uint4*)(xq + (size_t)v * K + b * QK_K + 128 * h + 32 * q + l0);
                da[k] = xd[(size_t)v * (K / QK8_1) + b * (QK_K / QK8_1) + 4 * h + q];
                off[k] = 32.0f * (float)dot16_s8(ones, xv[k]);    // 32 * sum(xq)
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const u32 wl[4] = {ql[r].x, ql[r].y, ql[r].z, ql[r].w};
                const u32 wh[4] = {qh[r].x, qh[r].y, qh[r].z, qh[r].w};
                const float d = f16_to_f32(dh[r]);
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const int q = m + 2 * k;
                    u32 u[4];
#pragma unroll
                    for (int w = 0; w < 4; ++w)
                        u[w] = ((wl[w] >> (4 * k)) & 0x0F0F0F0Fu) | (((wh[w] >> (2 * q)) & 0x03030303u) << 4);
                    const int sub = 8 * h + 2 * q + l0 / 16;
                    acc[r][v] += d * (float)(i8)byte_of(word_of(sc[r], sub / 4), sub % 4) * da[k] *
                                 ((float)dot16_s8(u, xv[k]) - off[k]);
                }
            }
        }
    }
}

// the 32-element group types: lane l takes groups l, l+32, ... of its rows
template <int QT, int R, int NB>
__device__ __forceinline__ void dot_q32(const u8* const (&rows)[R], const i8* __restrict__ xq,
                                        const float* __restrict__ xd, const float* __restrict__ xs,
                                        int K, int lane, int kw, int nkw, float (&acc)[R][NB]) {
    const int ng = K / 32;
    const u32 ones[8] = {0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u,
                         0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u};
    for (int gi = lane + 32 * kw; gi < ng; gi += 32 * nkw) {
        if constexpr (NB == 1) {
            const uint4 x0 = *(const uint4*)(xq + 32 * gi), x1 = *(const uint4*)(xq + 32 * gi + 16);
            const float da = xd[gi], sa = xs[gi];
            const int sx = dot32(ones, x0, x1);                // sum(xq)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const Group g = decode<QT>(rows[r], gi);
                acc[r][0] += g.a * da * (float)(dot32(g.u, x0, x1) - g.z * sx) + g.b * sa;
            }
            continue;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const Group g = decode<QT>(rows[r], gi);
#pragma unroll
            for (int v = 0; v < NB; ++v) {                   // x row v: the same sums as alone
                const i8* xv = xq + (size_t)v * K + 32 * gi;
                const uint4 x0 = *(const uint4*)xv, x1 = *(const uint4*)(xv + 16);
                const float da = xd[(size_t)v * ng + gi], sa = xs[(size_t)v * ng + gi];
                const int sx = dot32(ones, x0, x1);            // sum(xq)
                acc[r][v] += g.a * da * (float)(dot32(g.u, x0, x1) - g.z * sx) + g.b * sa;
            }
        }
    }
}

template <int QT, int R, int NB>
__device__ __forceinline__ void dot_rows(const u8* const (&rows)[R], const i8* __restrict__ xq,
                                         const float* __restrict__ xd, const float* __restrict__ xs,
                                         int K, int lane, int kw, int nkw, float (&acc)[R][NB]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int v = 0; v < NB; ++v) acc[r][v] = 0.0f;
    if constexpr (QT == QT_Q4K) dot_q4k<R, NB>(rows, xq, xd, xs, K, lane, kw, nkw, acc);
    else if constexpr (QT == QT_Q6K) dot_q6k<R, NB>(rows, xq, xd, K, lane, kw, nkw, acc);
    else dot_q32<QT, R, NB>(rows, xq, xd, xs, K, lane, kw, nkw, acc);
}

// One warp's (or, split, one block's) R rows from row0 of W (od, K) into y, for each
// of the NB rows of x (y, res and x row v at v*od, v*od, v*K).
template <int QT, int R, int NB>
__device__ __forceinline__ void rows_out(const u8* __restrict__ W, const float* __restrict__ bias,
                                         const float* res, float* y, int od, int row0, int K,
                                         const i8* __restrict__ xq, const float* __restrict__ xd,
                                         const float* __restrict__ xs, int split, int warp, int lane,
                                         float (&s_part)[MV_WARPS][R][NB]) {
    const u8* rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) rows[r] = W + (size_t)min(row0 + r, od - 1) * row_bytes<QT>(K);
    float acc[R][NB];
    dot_rows<QT, R, NB>(rows, xq, xd, xs, K, lane, warp % split, split, acc);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int v = 0; v < NB; ++v) acc[r][v] = warp_sum(acc[r][v]);
    if (split > 1) {
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int v = 0; v < NB; ++v) s_part[warp][r][v] = acc[r][v];
        }
        __syncthreads();
        if (warp != 0) return;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int v = 0; v < NB; ++v) {
                float t = s_part[0][r][v];
                for (int w = 1; w < split; ++w) t += s_part[w][r][v];
                acc[r][v] = t;
            }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (lane == 0 && row0 + r < od) {
#pragma unroll
            for (int v = 0; v < NB; ++v) {
                const size_t at = (size_t)v * od + row0 + r;
                float o = bias ? acc[r][v] + bias[row0 + r] : acc[r][v];
                if (res) o = res[at] + o;
                y[at] = o;
            }
        }
    }
}

// The grid holds the blocks of up to three weights, in order: this block's weight
// (seg) and its block index inside that weight's blocks (blk); per_block rows a block.
struct MvBlock { int seg, blk; };
__device__ __forceinline__ MvBlock mv_block(int per_block, int od0, int od1) {
    const int nb0 = (od0 + per_block - 1) / per_block, nb1 = (od1 + per_block - 1) / per_block;
    const int b = blockIdx.x;
    if (b >= nb0 + nb1) return {2, b - nb0 - nb1};
    if (b >= nb0) return {1, b - nb0};
    return {0, b};
}

// The first MV_PREFETCH bytes of the block's weight rows into L2 before it waits for
// x (its predecessor's output): from the kernel's arguments alone, reading nothing.
// Measured on decode (minfer bench's tg): 0.5-4 KB a block gain alike; the whole rows lose
// (the first wave's ~25 MB of prefetches compete with the loads that need them).
template <int QA, int QB, int R>
__device__ __forceinline__ void matvec_prefetch_l2(int K, int split, int qb_mask, const u8* W0, int od0,
                                                   const u8* W1, int od1, const u8* W2, int od2) {
    const int per_block = MV_WARPS * R / split;
    const MvBlock b = mv_block(per_block, od0, od1);
    const u8* W = b.seg == 0 ? W0 : b.seg == 1 ? W1 : W2;
    const int od = b.seg == 0 ? od0 : b.seg == 1 ? od1 : od2;
    const size_t rb = ((qb_mask >> b.seg) & 1) ? row_bytes<QB>(K) : row_bytes<QA>(K);
    const int r0 = b.blk * per_block, r1 = min(r0 + per_block, od);
    if (r0 < r1) block_prefetch_l2(W + (size_t)r0 * rb, min((size_t)(r1 - r0) * rb, (size_t)MV_PREFETCH));
}

// q8_1 x (NB, K) -> y_s (NB, od_s) = x @ W_s^T [+ bias_s] [+ res_s] for s = 0..2
// (od_s = 0: unused); weight s is of type QB where bit s of qb_mask is set, else QA
// (a q6_K attn_v beside q4_K q and k: one launch). Each weight row is read once for
// the NB rows of x, and each output is the sum it is for one row alone (NB = 1): the
// order of a row's sums depends on neither NB nor R.
// split 1: each warp owns R rows over all of K, a block MV_WARPS*R rows;
// split MV_WARPS: the block's warps share R rows, warp w taking every
// MV_WARPS-th slice of K, and their sums meet in shared memory (in warp order).
// grid = the blocks of the three weights, in order. One row of x keeps the register
// cap of MV_MIN_BLOCKS; several need more accumulators (R*NB a lane) and take what
// MV_MIN_BLOCKS_NB blocks a SM leave.
template <int QA, int QB, int R, int NB>
__global__ void __launch_bounds__(MV_WARPS * 32, NB == 1 ? MV_MIN_BLOCKS : MV_MIN_BLOCKS_NB)
matvec(const i8* __restrict__ xq, const float* __restrict__ xd, const float* __restrict__ xs, int K,
       int split, int qb_mask,
       const u8* __restrict__ W0, const float* __restrict__ bias0, const float* res0, float* y0, int od0,
       const u8* __restrict__ W1, const float* __restrict__ bias1, const float* res1, float* y1, int od1,
       const u8* __restrict__ W2, const float* __restrict__ bias2, const float* res2, float* y2, int od2) {
    matvec_prefetch_l2<QA, QB, R>(K, split, qb_mask, W0, od0, W1, od1, W2, od2);
    GRID_DEPENDENCY();
    __shared__ float s_part[MV_WARPS][R][NB];
    const MvBlock b = mv_block(MV_WARPS * R / split, od0, od1);
    const int seg = b.seg, blk = b.blk;
    const u8* W = W0; const float* bias = bias0; const float* res = res0; float* y = y0; int od = od0;
    if (seg == 2) { W = W2; bias = bias2; res = res2; y = y2; od = od2; }
    else if (seg == 1) { W = W1; bias = bias1; res = res1; y = y1; od = od1; }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (blk * (MV_WARPS / split) + warp / split) * R;
    if (row0 >= od) return;                    // split > 1: the whole block
    if ((qb_mask >> seg) & 1)
        rows_out<QB, R, NB>(W, bias, res, y, od, row0, K, xq, xd, xs, split, warp, lane, s_part);
    else
        rows_out<QA, R, NB>(W, bias, res, y, od, row0, K, xq, xd, xs, split, warp, lane, s_part);
}

#ifdef MINFER_SASS_INSTANTIATE
#define MINFER_MV(QA, QB) MINFER_MVR(QA, QB, 2, 1) MINFER_MVR(QA, QB, 4, 1) MINFER_MVR(QA, QB, 2, 2) \
    MINFER_MVR(QA, QB, 2, 4) MINFER_MVR(QA, QB, 2, 8)
#define MINFER_MVR(QA, QB, R, NB)                                                               \
    template __global__ void matvec<QA, QB, R, NB>(const i8*, const float*, const float*, int, int, int, \
        const u8*, const float*, const float*, float*, int,                                     \
        const u8*, const float*, const float*, float*, int,                                     \
        const u8*, const float*, const float*, float*, int);
MINFER_MV(12, 12) MINFER_MV(14, 14) MINFER_MV(12, 14) MINFER_MV(2, 2) MINFER_MV(3, 3) MINFER_MV(6, 6)
MINFER_MV(7, 7) MINFER_MV(8, 8) MINFER_MV(13, 13)
#endif
