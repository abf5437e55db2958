// Element-wise ops, f32, one thread per element (grid-stride).
#include "common.cuh"

// gate, up (n,) -> y (n,) = silu(gate) * up = gate / (1 + exp(-gate)) * up
// (ggml_vec_swiglu_f32); expf, not __expf: the fast intrinsic's error is visible in parity
extern "C" __global__ void
swiglu_f32(const float* __restrict__ gate, const float* __restrict__ up,
           float* __restrict__ y, long long n) {
    GRID_DEPENDENCY();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = gate[i];
        y[i] = g / (1.0f + expf(-g)) * up[i];
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
