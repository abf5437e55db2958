// Greedy selection on the device: logits (n,) f32 -> out[0] = the first index of
// the maximum (numpy.argmax's tie rule), out[1] = 1 if every logit is finite,
// else 0. One block of ARGMAX_THREADS; each thread scans a strided share in
// increasing index order (strict >, so it keeps its first maximum), then the
// block reduces (larger value wins; equal values: smaller index).
#include "common.cuh"

__device__ __forceinline__ void better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_f32(const float* __restrict__ x, int n, int* __restrict__ out) {
    GRID_DEPENDENCY();
    __shared__ float s_v[ARGMAX_THREADS / 32];
    __shared__ int s_i[ARGMAX_THREADS / 32], s_bad[ARGMAX_THREADS / 32];
    float v = -__int_as_float(0x7f800000);
    int idx = 0x7fffffff, bad = 0;
    for (int i = threadIdx.x; i < n; i += ARGMAX_THREADS) {
        const float e = x[i];
        bad |= !isfinite(e);
        if (e > v) { v = e; idx = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        better(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { s_v[warp] = v; s_i[warp] = idx; s_bad[warp] = bad; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ARGMAX_THREADS / 32; ++w) {
            better(v, idx, s_v[w], s_i[w]);
            bad |= s_bad[w];
        }
        out[0] = idx;
        out[1] = !bad;
    }
}

// A decode step's last launch: its greedy token becomes the next step's input and
// the position advances (feed = [token, pos]), so the host can queue the next
// replay of the step's CUDA graph before it has read this one's token.
extern "C" __global__ void advance_feed(const int* __restrict__ out, int* __restrict__ feed) {
    GRID_DEPENDENCY();
    feed[0] = out[0];
    feed[1] += 1;
}
