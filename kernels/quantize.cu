// Activations f32 -> q8_1-style blocks of 32 for the int8 MMQ GEMMs (mmq.cu).
// Mirrors ggml-cuda quantize_q8_1 (quantize.cu), except that the block sum is
// s = d * sum(q) of the quantized values (what the k-quant min term needs:
// dmin*m * sum_k(d_a*q_a[k]) = dmin*m * s), not the sum of the f32 inputs.
#include "common.cuh"

// x (T, K) f32 -> q (T, K) int8, d (T, K/32) f32, s (T, K/32) f32
//   d = amax/127, q = roundf(x/d) (round half away from zero; 0 when amax == 0),
//   s = d * sum(q).   One warp per 32-value block, lane i owns value i.
extern "C" __global__ void __launch_bounds__(THREADS_1D)
quantize_q8_1(const float* __restrict__ x, i8* __restrict__ q, float* __restrict__ d,
              float* __restrict__ s, long long n_blocks) {
    const long long b = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (b >= n_blocks) return;                       // whole warps exit together
    const int lane = threadIdx.x % 32;
    const float xi = x[b * QK8_1 + lane];
    float amax = fabsf(xi);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float db = amax / 127.0f;
    const int qi = amax == 0.0f ? 0 : (int)roundf(xi / db);
    int sum = qi;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    q[b * QK8_1 + lane] = (i8)qi;
    if (lane == 0) {
        d[b] = db;
        s[b] = db * (float)sum;
    }
}
