// Activations f32 -> q8_1-style blocks of 32 for the int8 GEMMs and matvecs
// (and the SwiGLU of a decode step's gate and up rows, straight to q8_1).
// Mirrors ggml-cuda quantize_q8_1 (quantize.cu), except that the block sum is
// s = d * sum(q) of the quantized values (what the k-quant min term needs:
// dmin*m * sum_k(d_a*q_a[k]) = dmin*m * s), not the sum of the f32 inputs.
#include "common.cuh"

// x (T, K) f32 -> q (T, K) int8, d (T, K/32) f32, s (T, K/32) f32 (common.cuh
// q8_1_block). One warp per 32-value block, lane i owns value i.
extern "C" __global__ void __launch_bounds__(THREADS_1D)
quantize_q8_1(const float* __restrict__ x, i8* __restrict__ q, float* __restrict__ d,
              float* __restrict__ s, long long n_blocks) {
    GRID_DEPENDENCY();
    const long long b = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (b >= n_blocks) return;                       // whole warps exit together
    const int lane = threadIdx.x % 32;
    q8_1_block(x[b * QK8_1 + lane], lane, q + b * QK8_1, d + b, s + b);
}

// gate, up (n,) f32 -> silu(gate) * up as q8_1 (elementwise.cu's swiglu_f32, then
// quantize_q8_1, bit for bit): the down projection's operand in a decode step.
// n a multiple of 32; one warp per block of 32.
extern "C" __global__ void __launch_bounds__(THREADS_1D)
swiglu_q8_1(const float* __restrict__ gate, const float* __restrict__ up, i8* __restrict__ q,
            float* __restrict__ d, float* __restrict__ s, long long n_blocks) {
    GRID_DEPENDENCY();
    const long long b = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (b >= n_blocks) return;
    const int lane = threadIdx.x % 32;
    q8_1_block(silu_mul(gate[b * QK8_1 + lane], up[b * QK8_1 + lane]), lane, q + b * QK8_1, d + b, s + b);
}
