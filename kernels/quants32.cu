// Dequantization of the types read in 32-element groups (q32_decode.cuh has the
// decoders): whole weights to f16 (the f16 engine's scratch) and rows to f32
// (embeddings). Their decode matvec is in matvec.cu.
#include "q32_decode.cuh"

__device__ __forceinline__ u32 f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// W (n_out, n_in) -> W16 (n_out, n_in) f16 bits, one thread per group; n_grp = n_out*n_in/32
template <int QT>
__global__ void __launch_bounds__(THREADS_1D)
dequant32_f16(const u8* __restrict__ W, u16* __restrict__ y, long long n_grp) {
    GRID_DEPENDENCY();
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n_grp) return;
    const Group r = decode<QT>(W, g);
    uint4* dst = (uint4*)(y + g * 32);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        u32 p[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            p[k] = f16_bits(value(r, 8 * c + 2 * k)) | (f16_bits(value(r, 8 * c + 2 * k + 1)) << 16);
        dst[c] = make_uint4(p[0], p[1], p[2], p[3]);
    }
}

// rows tok (T,) of W (rows, n) -> y (T, n) f32; grid (ceil(n/32 / THREADS_1D), T)
template <int QT>
__global__ void __launch_bounds__(THREADS_1D)
dequant32_rows(const u8* __restrict__ W, const int* __restrict__ tok, float* __restrict__ y, int n) {
    GRID_DEPENDENCY();
    const int t = blockIdx.y, gi = blockIdx.x * THREADS_1D + threadIdx.x;
    if (gi >= n / 32) return;
    const Group r = decode<QT>(W, (long long)tok[t] * (n / 32) + gi);
    float* dst = y + (size_t)t * n + 32 * gi;
#pragma unroll
    for (int e = 0; e < 32; ++e) dst[e] = value(r, e);
}

#ifdef MINFER_SASS_INSTANTIATE
#define MINFER_Q32(QT)                                                                        \
    template __global__ void dequant32_f16<QT>(const u8*, u16*, long long);                  \
    template __global__ void dequant32_rows<QT>(const u8*, const int*, float*, int);
MINFER_Q32(2) MINFER_Q32(3) MINFER_Q32(6) MINFER_Q32(7) MINFER_Q32(8) MINFER_Q32(13)
#endif
