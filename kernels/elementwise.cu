// Element-wise ops, f32, one thread per element (grid-stride).
#include "common.cuh"

// gate, up (n,) -> y (n,) = silu(gate) * up = gate / (1 + exp(-gate)) * up
// (common.cuh's silu_mul)
extern "C" __global__ void
swiglu_f32(const float* __restrict__ gate, const float* __restrict__ up,
           float* __restrict__ y, long long n) {
    GRID_DEPENDENCY();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = silu_mul(gate[i], up[i]);
    }
}

// a, b (n,) -> y (n,) = a + b (residual add; y may alias a)
extern "C" __global__ void
add_f32(const float* a, const float* b, float* y, long long n) {
    GRID_DEPENDENCY();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = a[i] + b[i];
}
