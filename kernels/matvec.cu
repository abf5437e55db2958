// M=1 (decode) matrix-vector kernels on quantized weights, with x given as q8_1
// blocks of 32 (quantize.cu: int8 q, scale d_a, sum s_a = d_a*sum(q)), as
// ggml-cuda's mul_mat_vec_q does: the dot of a weight slice with x is an integer
// dot (dp4a, four int8 products per instruction) rescaled once per sub-block.
// With x in f32 every weight element cost a nibble extraction, a conversion and
// an FMA, and the kernels were bound by those instructions at about a third of
// the memory bandwidth.
//   y (od,) = W (od, K) @ x (K,) [+ bias]
// A warp owns MV_RPW consecutive output rows, MV_WARPS warps per block. Each lane
// owns one 16-byte slice of a super-block's quants (8 lanes per super-block, 4
// super-blocks per warp step) in all of its rows: it loads its 32 bytes of x once
// and applies them to the MV_RPW rows' quants (uint4 loads, coalesced). Rows past
// od are clamped to the last row (computed, never written), so the loop body has
// no branch between its loads. The lanes' partial sums meet in a warp reduction.
#include "common.cuh"

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// byte k (0..3) of a 32-bit word
__device__ __forceinline__ int byte_of(u32 w, int k) { return (w >> (8 * k)) & 0xFF; }

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
    for (int u = 0; u < 2; ++u) {
        const int jj = j + u;
        if (jj < 4) {
            sc[u] = byte_of(s0, jj) & 63;
            m[u] = byte_of(s1, jj) & 63;
        } else {
            sc[u] = (byte_of(s2, jj - 4) & 0xF) | ((byte_of(s0, jj - 4) >> 6) << 4);
            m[u] = (byte_of(s2, jj - 4) >> 4) | ((byte_of(s1, jj - 4) >> 6) << 4);
        }
    }
}

// q4_K rows as stored (144-byte blocks): W (od, K/256*144); x as q8_1 xq (K,) int8,
// xd, xs (K/32,); y (od,). Lane slice c (0..7) = qs[16c .. 16c+15]: chunk i = c/2 of
// 32 bytes holds elements l0..l0+15 (l0 = 16*(c%2)) of sub-block 2i (low nibbles)
// and of sub-block 2i+1 (high nibbles). Per sub-block j:
//   y += d*sc_j * d_a * sum(q*xq) - dmin*m_j * s_a
// the min term once per sub-block (by the l0 == 0 lane). The block's first 16 bytes
// (d, dmin, scales) come in as one uint4.
extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)
matvec_q4k(const u8* __restrict__ W, const i8* __restrict__ xq, const float* __restrict__ xd,
           const float* __restrict__ xs, const float* __restrict__ bias, float* __restrict__ y,
           int od, int K) {
    const int row0 = (blockIdx.x * MV_WARPS + threadIdx.x / 32) * MV_RPW, lane = threadIdx.x % 32;
    if (row0 >= od) return;
    const int nb = K / QK_K;
    const int c = lane % 8, i = c / 2, l0 = (c % 2) * 16;
    const float first = l0 == 0 ? 1.0f : 0.0f;          // this lane adds the min terms
    const u8* rows[MV_RPW];
#pragma unroll
    for (int r = 0; r < MV_RPW; ++r) rows[r] = W + (size_t)min(row0 + r, od - 1) * nb * Q4K_BYTES;
    float acc[MV_RPW];
#pragma unroll
    for (int r = 0; r < MV_RPW; ++r) acc[r] = 0.0f;
    for (int b = lane / 8; b < nb; b += 4) {
        uint4 hd[MV_RPW], q[MV_RPW];
#pragma unroll
        for (int r = 0; r < MV_RPW; ++r) {
            const u8* blk = rows[r] + (size_t)b * Q4K_BYTES;
            hd[r] = *(const uint4*)blk;
            q[r] = *(const uint4*)(blk + Q4K_QS + 16 * c);
        }
        const int e0 = b * QK_K + 64 * i + l0, g0 = b * (QK_K / QK8_1) + 2 * i;
        const uint4 xa = *(const uint4*)(xq + e0), xb = *(const uint4*)(xq + e0 + 32);
        const float da0 = xd[g0], da1 = xd[g0 + 1], sa0 = first * xs[g0], sa1 = first * xs[g0 + 1];
#pragma unroll
        for (int r = 0; r < MV_RPW; ++r) {
            const u32 lo[4] = {q[r].x & 0x0F0F0F0Fu, q[r].y & 0x0F0F0F0Fu,
                               q[r].z & 0x0F0F0F0Fu, q[r].w & 0x0F0F0F0Fu};
            const u32 hi[4] = {(q[r].x >> 4) & 0x0F0F0F0Fu, (q[r].y >> 4) & 0x0F0F0F0Fu,
                               (q[r].z >> 4) & 0x0F0F0F0Fu, (q[r].w >> 4) & 0x0F0F0F0Fu};
            int sc[2], m[2];
            q4k_scales2(2 * i, hd[r].y, hd[r].z, hd[r].w, sc, m);
            const float d = f16_to_f32((u16)(hd[r].x & 0xFFFF)), dmin = f16_to_f32((u16)(hd[r].x >> 16));
            acc[r] += d * (float)sc[0] * da0 * (float)dot16_s8(lo, xa) - dmin * (float)m[0] * sa0;
            acc[r] += d * (float)sc[1] * da1 * (float)dot16_s8(hi, xb) - dmin * (float)m[1] * sa1;
        }
    }
#pragma unroll
    for (int r = 0; r < MV_RPW; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < od) y[row0 + r] = bias ? v + bias[row0 + r] : v;
    }
}

// q6_K rows padded (224-byte stride): W (od, K/256*224); x as q8_1; y (od,).
// Lane slice c (0..7) = ql[16c .. 16c+15]: half h = c/4, m = (c/2)%2, l0 = 16*(c%2);
// the low nibbles are quarter q=m, the high ones q=m+2 (elements 128h + 32q + l0 + e),
// with the 2-bit field 2q of qh[32h + l0 + e] on top: u = ql_nibble | qh_bits << 4 in
// 0..63 (a non-negative int8), and the weight is u - 32, so per 16-element sub-block
//   y += d*sc * d_a * (sum(u*xq) - 32*sum(xq))
// with sum(xq) formed once per slice for all rows. ql, qh and the 16 scales come in
// as uint4s, d as one 16-bit load.
extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)
matvec_q6k(const u8* __restrict__ W, const i8* __restrict__ xq, const float* __restrict__ xd,
           const float* __restrict__ bias, float* __restrict__ y, int od, int K) {
    const int row0 = (blockIdx.x * MV_WARPS + threadIdx.x / 32) * MV_RPW, lane = threadIdx.x % 32;
    if (row0 >= od) return;
    const int nb = K / QK_K;
    const int c = lane % 8, h = c / 4, m = (c / 2) % 2, l0 = (c % 2) * 16;
    const u8* rows[MV_RPW];
#pragma unroll
    for (int r = 0; r < MV_RPW; ++r) rows[r] = W + (size_t)min(row0 + r, od - 1) * nb * Q6K_PADDED;
    float acc[MV_RPW];
#pragma unroll
    for (int r = 0; r < MV_RPW; ++r) acc[r] = 0.0f;
    const u32 ones[4] = {0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u};
    for (int b = lane / 8; b < nb; b += 4) {
        uint4 ql[MV_RPW], qh[MV_RPW], sc[MV_RPW];
        u16 dh[MV_RPW];
#pragma unroll
        for (int r = 0; r < MV_RPW; ++r) {
            const u8* blk = rows[r] + (size_t)b * Q6K_PADDED;
            ql[r] = *(const uint4*)(blk + 16 * c);
            qh[r] = *(const uint4*)(blk + Q6K_QH + 32 * h + l0);
            sc[r] = *(const uint4*)(blk + Q6K_SC);
            dh[r] = *(const u16*)(blk + Q6K_D);
        }
        uint4 xv[2];
        float da[2], off[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {                         // k=0: low nibbles, k=1: high
            const int q = m + 2 * k;
            xv[k] = *(const uint4*)(xq + b * QK_K + 128 * h + 32 * q + l0);
            da[k] = xd[b * (QK_K / QK8_1) + 4 * h + q];
            off[k] = 32.0f * (float)dot16_s8(ones, xv[k]);    // 32 * sum(xq)
        }
#pragma unroll
        for (int r = 0; r < MV_RPW; ++r) {
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
                acc[r] += d * (float)(i8)byte_of(word_of(sc[r], sub / 4), sub % 4) * da[k] *
                          ((float)dot16_s8(u, xv[k]) - off[k]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MV_RPW; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < od) y[row0 + r] = bias ? v + bias[row0 + r] : v;
    }
}
