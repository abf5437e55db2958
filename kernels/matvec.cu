// M=1 (decode) matrix-vector kernels on quantized weights, x in f32 (no
// activation quantization: more accurate than q8_1 and just as fast at M=1,
// where the weight bytes are the whole cost). Mirrors ggml-cuda's
// dequantize_mul_mat_vec_q4_k / _q6_k role.
//   y (od,) = W (od, K) @ x (K,) [+ bias]
// One warp per output row, MV_ROWS rows per block. Each lane owns one
// 16-byte slice of a super-block's quants (8 lanes per super-block, 4 super-
// blocks per warp step); quants come in as one uint4 (coalesced 16-B loads),
// x as float4s. The lane's partial sums meet in a warp shuffle reduction.
#include "common.cuh"

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// sum_e nib_e(q) * x[e] over the 16 bytes of q (nibble at `shift`), and sum_e x[e]
__device__ __forceinline__ float dot16(uint4 q, int shift, const float* __restrict__ x) {
    const u32 w[4] = {q.x, q.y, q.z, q.w};
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 xv = *(const float4*)(x + 4 * k);
        const u32 v = w[k] >> shift;
        s += (float)(v & 0xF) * xv.x + (float)((v >> 8) & 0xF) * xv.y +
             (float)((v >> 16) & 0xF) * xv.z + (float)((v >> 24) & 0xF) * xv.w;
    }
    return s;
}

__device__ __forceinline__ float sum16(const float* __restrict__ x) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 xv = *(const float4*)(x + 4 * k);
        s += xv.x + xv.y + xv.z + xv.w;
    }
    return s;
}

// q4_K rows as stored (144-byte blocks): W (od, K/256*144), x (K,), y (od,)
// lane slice c (0..7) = qs[16c .. 16c+15]: group i = c/2 of 32 bytes holds
// sub-block 2i (low nibbles) and 2i+1 (high nibbles); y += d*sc*dot - dmin*m*sum(x).
extern "C" __global__ void __launch_bounds__(MV_ROWS * 32)
matvec_q4k(const u8* __restrict__ W, const float* __restrict__ x, const float* __restrict__ bias,
           float* __restrict__ y, int od, int K) {
    const int row = blockIdx.x * MV_ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= od) return;
    const int nb = K / QK_K;
    const u8* wrow = W + (size_t)row * nb * Q4K_BYTES;
    const int c = lane % 8, i = c / 2, l0 = (c % 2) * 16;
    float acc = 0.0f;
    for (int b = lane / 8; b < nb; b += 4) {
        const u8* blk = wrow + (size_t)b * Q4K_BYTES;
        const uint4 q = *(const uint4*)(blk + Q4K_QS + 16 * c);
        const float* xb = x + (size_t)b * QK_K + 64 * i + l0;
        int sc0, m0, sc1, m1;
        q4k_scale_min(2 * i, blk + 4, &sc0, &m0);
        q4k_scale_min(2 * i + 1, blk + 4, &sc1, &m1);
        const float d = load_f16(blk), dmin = load_f16(blk + 2);
        acc += d * (float)sc0 * dot16(q, 0, xb) - dmin * (float)m0 * sum16(xb);
        acc += d * (float)sc1 * dot16(q, 4, xb + 32) - dmin * (float)m1 * sum16(xb + 32);
    }
    acc = warp_sum(acc);
    if (lane == 0) y[row] = bias ? acc + bias[row] : acc;
}

// q6_K rows padded (224-byte stride): W (od, K/256*224), x (K,), y (od,)
// lane slice c (0..7) = ql[16c .. 16c+15]: half h = c/4, m = (c/2)%2, l0 = 16*(c%2);
// the low nibbles are quarter q=m, the high ones q=m+2 (elements 128h + 32q + l0 + e),
// qh[32h + l0 + e] >> 2q on top, centered by -32; scale of sub-block 8h + 2q + l0/16.
extern "C" __global__ void __launch_bounds__(MV_ROWS * 32)
matvec_q6k(const u8* __restrict__ W, const float* __restrict__ x, const float* __restrict__ bias,
           float* __restrict__ y, int od, int K) {
    const int row = blockIdx.x * MV_ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= od) return;
    const int nb = K / QK_K;
    const u8* wrow = W + (size_t)row * nb * Q6K_PADDED;
    const int c = lane % 8, h = c / 4, m = (c / 2) % 2, l0 = (c % 2) * 16;
    float acc = 0.0f;
    for (int b = lane / 8; b < nb; b += 4) {
        const u8* blk = wrow + (size_t)b * Q6K_PADDED;
        const uint4 ql = *(const uint4*)(blk + 16 * c);
        const uint4 qh = *(const uint4*)(blk + Q6K_QH + 32 * h + l0);
        const u32 wl[4] = {ql.x, ql.y, ql.z, ql.w}, wh[4] = {qh.x, qh.y, qh.z, qh.w};
        const float d = load_f16(blk + Q6K_D);
#pragma unroll
        for (int k = 0; k < 2; ++k) {                     // k=0: low nibbles, k=1: high
            const int q = m + 2 * k;
            const float* xb = x + (size_t)b * QK_K + 128 * h + 32 * q + l0;
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const float4 xv = *(const float4*)(xb + 4 * w);
                const u32 lo = wl[w] >> (4 * k), hi = wh[w] >> (2 * q);
                s += (float)((int)((lo & 0xF) | ((hi & 3) << 4)) - 32) * xv.x +
                     (float)((int)(((lo >> 8) & 0xF) | (((hi >> 8) & 3) << 4)) - 32) * xv.y +
                     (float)((int)(((lo >> 16) & 0xF) | (((hi >> 16) & 3) << 4)) - 32) * xv.z +
                     (float)((int)(((lo >> 24) & 0xF) | (((hi >> 24) & 3) << 4)) - 32) * xv.w;
            }
            const int sub = 8 * h + 2 * q + l0 / 16;
            acc += d * (float)(i8)blk[Q6K_SC + sub] * s;
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) y[row] = bias ? acc + bias[row] : acc;
}
