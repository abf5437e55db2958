// M=1 (decode) matrix-vector kernels on quantized weights, x in f32 (no
// activation quantization: more accurate than q8_1). Mirrors ggml-cuda's
// dequantize_mul_mat_vec_q4_k / _q6_k role.
//   y (od,) = W (od, K) @ x (K,) [+ bias]
// A warp owns MV_RPW consecutive output rows, MV_WARPS warps per block. Each lane
// owns one 16-byte slice of a super-block's quants (8 lanes per super-block, 4
// super-blocks per warp step) in all of its rows: it loads its slice of x once
// (float4s) and applies it to the MV_RPW rows' quants (one uint4 each, coalesced
// 16-byte loads), so x costs one load per MV_RPW rows instead of one per row:
// x, not the weights, was what one row per warp spent its time loading. Each
// row's sum is formed in the same order as with one row per warp (per lane over
// its super-blocks, then the warp shuffle reduction).
#include "common.cuh"

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// x (16,) as float4 registers
struct X16 { float4 v[4]; };

__device__ __forceinline__ X16 load_x16(const float* __restrict__ x) {
    X16 r;
#pragma unroll
    for (int k = 0; k < 4; ++k) r.v[k] = *(const float4*)(x + 4 * k);
    return r;
}

// sum_e nib_e(q) * x[e] over the 16 bytes of q (nibble at `shift`)
__device__ __forceinline__ float dot16(uint4 q, int shift, const X16& x) {
    const u32 w[4] = {q.x, q.y, q.z, q.w};
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 xv = x.v[k];
        const u32 v = w[k] >> shift;
        s += (float)(v & 0xF) * xv.x + (float)((v >> 8) & 0xF) * xv.y +
             (float)((v >> 16) & 0xF) * xv.z + (float)((v >> 24) & 0xF) * xv.w;
    }
    return s;
}

__device__ __forceinline__ float sum16(const X16& x) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) s += x.v[k].x + x.v[k].y + x.v[k].z + x.v[k].w;
    return s;
}

// q4_K rows as stored (144-byte blocks): W (od, K/256*144), x (K,), y (od,)
// lane slice c (0..7) = qs[16c .. 16c+15]: group i = c/2 of 32 bytes holds
// sub-block 2i (low nibbles) and 2i+1 (high nibbles); y += d*sc*dot - dmin*m*sum(x).
extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)
matvec_q4k(const u8* __restrict__ W, const float* __restrict__ x, const float* __restrict__ bias,
           float* __restrict__ y, int od, int K) {
    const int row0 = (blockIdx.x * MV_WARPS + threadIdx.x / 32) * MV_RPW, lane = threadIdx.x % 32;
    if (row0 >= od) return;
    const int nb = K / QK_K;
    const int c = lane % 8, i = c / 2, l0 = (c % 2) * 16;
    float acc[MV_RPW];
#pragma unroll
    for (int r = 0; r < MV_RPW; ++r) acc[r] = 0.0f;
    for (int b = lane / 8; b < nb; b += 4) {
        const float* xb = x + (size_t)b * QK_K + 64 * i + l0;
        const X16 x0 = load_x16(xb), x1 = load_x16(xb + 32);
        const float s0 = sum16(x0), s1 = sum16(x1);
#pragma unroll
        for (int r = 0; r < MV_RPW; ++r) {
            if (row0 + r >= od) break;
            const u8* blk = W + ((size_t)(row0 + r) * nb + b) * Q4K_BYTES;
            const uint4 q = *(const uint4*)(blk + Q4K_QS + 16 * c);
            int sc0, m0, sc1, m1;
            q4k_scale_min(2 * i, blk + 4, &sc0, &m0);
            q4k_scale_min(2 * i + 1, blk + 4, &sc1, &m1);
            const float d = load_f16(blk), dmin = load_f16(blk + 2);
            acc[r] += d * (float)sc0 * dot16(q, 0, x0) - dmin * (float)m0 * s0;
            acc[r] += d * (float)sc1 * dot16(q, 4, x1) - dmin * (float)m1 * s1;
        }
    }
#pragma unroll
    for (int r = 0; r < MV_RPW; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < od) y[row0 + r] = bias ? v + bias[row0 + r] : v;
    }
}

// q6_K rows padded (224-byte stride): W (od, K/256*224), x (K,), y (od,)
// lane slice c (0..7) = ql[16c .. 16c+15]: half h = c/4, m = (c/2)%2, l0 = 16*(c%2);
// the low nibbles are quarter q=m, the high ones q=m+2 (elements 128h + 32q + l0 + e),
// qh[32h + l0 + e] >> 2q on top, centered by -32; scale of sub-block 8h + 2q + l0/16.
extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)
matvec_q6k(const u8* __restrict__ W, const float* __restrict__ x, const float* __restrict__ bias,
           float* __restrict__ y, int od, int K) {
    const int row0 = (blockIdx.x * MV_WARPS + threadIdx.x / 32) * MV_RPW, lane = threadIdx.x % 32;
    if (row0 >= od) return;
    const int nb = K / QK_K;
    const int c = lane % 8, h = c / 4, m = (c / 2) % 2, l0 = (c % 2) * 16;
    float acc[MV_RPW];
#pragma unroll
    for (int r = 0; r < MV_RPW; ++r) acc[r] = 0.0f;
    for (int b = lane / 8; b < nb; b += 4) {
        const float* xq = x + (size_t)b * QK_K + 128 * h + l0;
        const X16 xs[2] = {load_x16(xq + 32 * m), load_x16(xq + 32 * (m + 2))};
#pragma unroll
        for (int r = 0; r < MV_RPW; ++r) {
            if (row0 + r >= od) break;
            const u8* blk = W + ((size_t)(row0 + r) * nb + b) * Q6K_PADDED;
            const uint4 ql = *(const uint4*)(blk + 16 * c);
            const uint4 qh = *(const uint4*)(blk + Q6K_QH + 32 * h + l0);
            const u32 wl[4] = {ql.x, ql.y, ql.z, ql.w}, wh[4] = {qh.x, qh.y, qh.z, qh.w};
            const float d = load_f16(blk + Q6K_D);
#pragma unroll
            for (int k = 0; k < 2; ++k) {                     // k=0: low nibbles, k=1: high
                const int q = m + 2 * k;
                float s = 0.0f;
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    const float4 xv = xs[k].v[w];
                    const u32 lo = wl[w] >> (4 * k), hi = wh[w] >> (2 * q);
                    s += (float)((int)((lo & 0xF) | ((hi & 3) << 4)) - 32) * xv.x +
                         (float)((int)(((lo >> 8) & 0xF) | (((hi >> 8) & 3) << 4)) - 32) * xv.y +
                         (float)((int)(((lo >> 16) & 0xF) | (((hi >> 16) & 3) << 4)) - 32) * xv.z +
                         (float)((int)(((lo >> 24) & 0xF) | (((hi >> 24) & 3) << 4)) - 32) * xv.w;
                }
                const int sub = 8 * h + 2 * q + l0 / 16;
                acc[r] += d * (float)(i8)blk[Q6K_SC + sub] * s;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MV_RPW; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < od) y[row0 + r] = bias ? v + bias[row0 + r] : v;
    }
}
