// RMSNorm, f32 (mirrors ggml_compute_forward_rms_norm + the weight multiply):
//   y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w
// One block per row; the sum of squares is reduced in f32 (warp shuffles, then
// one value per warp through shared memory).

#include "common.cuh"

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// x (rows, d), w (d,) -> y (rows, d); grid = rows, block = NORM_THREADS
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w,
            float* __restrict__ y, int d, float eps) {
    const size_t row = blockIdx.x;
    const float* xr = x + row * (size_t)d;
    float* yr = y + row * (size_t)d;

    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += NORM_THREADS) ss += xr[i] * xr[i];
    ss = warp_sum(ss);

    __shared__ float part[NORM_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float v = lane < NORM_THREADS / 32 ? part[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) part[0] = v;
    }
    __syncthreads();
    // 1/sqrt, not rsqrtf: rsqrtf's ~2 ulp would add a needless difference to the CPU reference
    const float scale = 1.0f / sqrtf(part[0] / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += NORM_THREADS) yr[i] = xr[i] * scale * w[i];
}
