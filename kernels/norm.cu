// RMSNorm, f32 (mirrors ggml_compute_forward_rms_norm + the weight multiply):
//   y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w
// One block per row; the sum of squares is reduced in f32 (warp shuffles, then
// one value per warp through shared memory). rmsnorm_q8_1 writes the same values
// as q8_1 blocks (the operand of the decode matvecs), rmsnorm_f16 rounded to f16
// (the operand of the f16 engine's GEMMs) instead of f32.

#include "common.cuh"

// A row's elements held per thread: thread t owns elements t + NORM_THREADS * j
// (j < NORM_PER) of x and w, loaded together at the start, so the weight's loads
// (cold, from DRAM) overlap the row's, and the output pass reads registers; every
// output pass (f32, f16, q8_1) visits those same elements. Longer rows than
// NORM_THREADS * NORM_PER go through the loops of row_scale_loop. 4: rows up to
// 4,096 (the 7B's 3,584) at 32 registers a thread, two blocks an SM; 8 spilled.
#define NORM_PER 4

// 1 / sqrt(mean(xr^2) + eps) of one row from the NORM_THREADS / 32 warps' partial
// sums in part (part[w]: warp w's sum of its threads' partial sums): warp 0 adds
// them, every thread of the block gets the result
__device__ __forceinline__ float scale_from_parts(float* part, int d, float eps) {
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp == 0) {
        float v = lane < NORM_THREADS / 32 ? part[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) part[0] = v;
    }
    __syncthreads();
    // 1/sqrt, not rsqrtf: rsqrtf's ~2 ulp would add a needless difference to the CPU reference
    return 1.0f / sqrtf(part[0] / (float)d + eps);
}

// the row's scale from each thread's partial sum of squares (its elements in index
// order), every thread of the block (NORM_THREADS) gets it
__device__ __forceinline__ float block_scale(float ss, int d, float eps) {
    __shared__ float part[NORM_THREADS / 32];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    return scale_from_parts(part, d, eps);
}

// this thread's elements of xr and w (zero past d) -> the row's scale
__device__ __forceinline__ float row_scale_regs(const float* __restrict__ xr, const float* __restrict__ w,
                                                int d, float eps, float (&xv)[NORM_PER],
                                                float (&wv)[NORM_PER]) {
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j) {
        const int i = threadIdx.x + j * NORM_THREADS;
        xv[j] = i < d ? xr[i] : 0.0f;
        wv[j] = i < d ? w[i] : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j)
        if (threadIdx.x + j * NORM_THREADS < d) ss += xv[j] * xv[j];
    return block_scale(ss, d, eps);
}

// the same scale for rows of any length, reading xr in a loop
__device__ __forceinline__ float row_scale_loop(const float* __restrict__ xr, int d, float eps) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += NORM_THREADS) ss += xr[i] * xr[i];
    return block_scale(ss, d, eps);
}

// One row's normed values x[i] * scale * w[i], each handed to store(i, value): the
// element-wise outputs (f32, f16) differ only in how they store a value
template <typename Store>
__device__ __forceinline__ void normed_row(const float* __restrict__ xr, const float* __restrict__ w,
                                           int d, float eps, Store store) {
    if (d <= NORM_THREADS * NORM_PER) {
        float xv[NORM_PER], wv[NORM_PER];
        const float scale = row_scale_regs(xr, w, d, eps, xv, wv);
#pragma unroll
        for (int j = 0; j < NORM_PER; ++j) {
            const int i = threadIdx.x + j * NORM_THREADS;
            if (i < d) store(i, xv[j] * scale * wv[j]);
        }
        return;
    }
    const float scale = row_scale_loop(xr, d, eps);
    for (int i = threadIdx.x; i < d; i += NORM_THREADS) store(i, xr[i] * scale * w[i]);
}

// x (rows, d), w (d,) -> y (rows, d); grid = rows, block = NORM_THREADS
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w,
            float* __restrict__ y, int d, float eps) {
    GRID_DEPENDENCY();
    const size_t row = blockIdx.x;
    float* yr = y + row * (size_t)d;
    normed_row(x + row * (size_t)d, w, d, eps, [yr](int i, float v) { yr[i] = v; });
}

// x (rows, d), w (d,) -> the normed rows as q8_1: q (rows, d) int8, qd, qs (rows, d/32);
// d a multiple of 32; grid = rows, block = NORM_THREADS (a warp per block of 32:
// warp w's blocks w + 32 j hold exactly its threads' elements)
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_q8_1(const float* __restrict__ x, const float* __restrict__ w, i8* __restrict__ q,
             float* __restrict__ qd, float* __restrict__ qs, int d, float eps) {
    block_prefetch_l2(w, (unsigned long long)d * sizeof(float));   // the norm weight (cold)
    GRID_DEPENDENCY();
    const size_t row = blockIdx.x;
    const float* xr = x + row * (size_t)d;
    const int lane = threadIdx.x & 31, nb = d / QK8_1;
    if (d <= NORM_THREADS * NORM_PER) {
        float xv[NORM_PER], wv[NORM_PER];
        const float scale = row_scale_regs(xr, w, d, eps, xv, wv);
#pragma unroll
        for (int j = 0; j < NORM_PER; ++j) {
            const int b = threadIdx.x / 32 + j * (NORM_THREADS / 32);     // warp-uniform
            if (b < nb) {
                const size_t g = row * nb + b;
                q8_1_block(xv[j] * scale * wv[j], lane, q + g * QK8_1, qd + g, qs + g);
            }
        }
        return;
    }
    const float scale = row_scale_loop(xr, d, eps);
    for (int b = threadIdx.x / 32; b < nb; b += NORM_THREADS / 32) {
        const int i = b * QK8_1 + lane;
        const size_t g = row * nb + b;
        q8_1_block(xr[i] * scale * w[i], lane, q + g * QK8_1, qd + g, qs + g);
    }
}

// x (rows, d), w (d,) -> y (rows, d) f16: rmsnorm_f32's values rounded once to f16,
// the f16 engine's GEMM operand written directly (the bits of rmsnorm_f32 then
// cast_f32_f16, without the f32 round trip); grid = rows, block = NORM_F16_THREADS.
// A prompt's rows: at NORM_THREADS threads a row of the 7B is 3.5 elements a thread
// and the block's set-up and barriers are most of its time. Here thread t stands in
// for the NORM_NV threads t + NORM_F16_THREADS * m of rmsnorm_f32's block: their
// elements, their partial sums in the same order, the same warp trees (thread
// t + NORM_F16_THREADS * m is lane t % 32 of warp t / 32 + (NORM_F16_THREADS / 32) * m,
// and its lane here is the same) and the same sum over warps: the same scale, bit
// for bit.
#define NORM_NV (NORM_THREADS / NORM_F16_THREADS)
static_assert(NORM_THREADS % NORM_F16_THREADS == 0 && NORM_F16_THREADS % 32 == 0, "whole warps stand in");

extern "C" __global__ void __launch_bounds__(NORM_F16_THREADS)
rmsnorm_f16(const float* __restrict__ x, const float* __restrict__ w,
            u16* __restrict__ y, int d, float eps) {
    GRID_DEPENDENCY();
    __shared__ float part[NORM_THREADS / 32];
    const size_t row = blockIdx.x;
    const float* xr = x + row * (size_t)d;
    u16* yr = y + row * (size_t)d;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    if (d <= NORM_THREADS * NORM_PER) {
        float xv[NORM_NV][NORM_PER], wv[NORM_NV][NORM_PER];
#pragma unroll
        for (int m = 0; m < NORM_NV; ++m)
#pragma unroll
            for (int j = 0; j < NORM_PER; ++j) {
                const int i = t + NORM_F16_THREADS * m + NORM_THREADS * j;
                xv[m][j] = i < d ? xr[i] : 0.0f;
                wv[m][j] = i < d ? w[i] : 0.0f;
            }
#pragma unroll
        for (int m = 0; m < NORM_NV; ++m) {
            float ss = 0.0f;                          // row_scale_regs' sum, for thread t + 256m
#pragma unroll
            for (int j = 0; j < NORM_PER; ++j)
                if (t + NORM_F16_THREADS * m + NORM_THREADS * j < d) ss += xv[m][j] * xv[m][j];
            ss = warp_sum(ss);
            if (lane == 0) part[warp + (NORM_F16_THREADS / 32) * m] = ss;
        }
        const float scale = scale_from_parts(part, d, eps);
#pragma unroll
        for (int m = 0; m < NORM_NV; ++m)
#pragma unroll
            for (int j = 0; j < NORM_PER; ++j) {
                const int i = t + NORM_F16_THREADS * m + NORM_THREADS * j;
                if (i < d) yr[i] = (u16)f16_bits_rn(xv[m][j] * scale * wv[m][j]);
            }
        return;
    }
#pragma unroll
    for (int m = 0; m < NORM_NV; ++m) {               // row_scale_loop's sums
        float ss = 0.0f;
        for (int i = t + NORM_F16_THREADS * m; i < d; i += NORM_THREADS) ss += xr[i] * xr[i];
        ss = warp_sum(ss);
        if (lane == 0) part[warp + (NORM_F16_THREADS / 32) * m] = ss;
    }
    const float scale = scale_from_parts(part, d, eps);
    for (int i = t; i < d; i += NORM_F16_THREADS) yr[i] = (u16)f16_bits_rn(xr[i] * scale * w[i]);
}
