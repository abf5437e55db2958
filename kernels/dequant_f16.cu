// Whole-weight dequantization to fp16 for the cuBLAS prefill path (cuda_fast.py):
// W (n_out, n_in) quantized -> W16 (n_out, n_in) f16, then x16 @ W16^T on tensor
// cores. Each output is the f32 value of the NumPy reference (gguf.quants /
// minfer.quants, ggml's dequantize_row_q4_K / _q6_K) rounded to f16 (RNE):
//   q4_K: y = (d*sc) * q - (dmin*m)      q in 0..15,  sc/m 6-bit per 32 elements
//   q6_K: y = (d*sc) * q                 q in -32..31, sc int8 per 16 elements
// Every product and the difference is rounded separately (__fmul_rn/__fsub_rn)
// so the compiler cannot contract them into an FMA: NumPy rounds each step.
//
// Memory-bound: super-blocks of a row are contiguous and rows are contiguous, so
// block b of the flattened weight covers outputs b*256 .. b*256+255 whatever the
// row length. 16-byte loads and stores; indices in 64 bits (the 7B output weight
// has 545M elements, 1.09 GB as f16).
//
// Bytes moved per 256 outputs (read + write): q4_K 144 + 512, q6_K padded 224 + 512
// (only the ql/qh/scale sectors each thread needs), q6_K from W_exp 256 + 32 + 512.

#include "common.cuh"

// f32 -> f16 bits, round to nearest even (= numpy's float32 -> float16)
__device__ __forceinline__ u32 f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// two f16 bits -> one u32, lo in the low half (the lower address in memory)
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    return f32_to_f16(lo) | (f32_to_f16(hi) << 16);
}

// byte k of a 16-byte vector
__device__ __forceinline__ u32 byte_of(const uint4& v, int k) {
    const u32 w = k < 4 ? v.x : k < 8 ? v.y : k < 12 ? v.z : v.w;
    return (w >> (8 * (k & 3))) & 0xFF;
}

// q4_K (raw ggml blocks, 144 B) -> f16. One thread per 32-element sub-block j of
// super-block b: 16 B header + 32 B of qs in, 64 B out.
// w: (n_out, n_in/256*144) u8, y: (n_out, n_in) f16 bits, n_sub = n_out*n_in/32
extern "C" __global__ void __launch_bounds__(256)
dequant_q4k_f16(const u8* __restrict__ w, u16* __restrict__ y, long long n_sub) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_sub) return;
    const long long b = i >> 3;
    const int j = (int)(i & 7);
    const u8* blk = w + b * Q4K_BYTES;                       // 144 = 9*16: aligned
    const uint4 hdr = *(const uint4*)blk;                    // d | dmin | scales[12]
    // sub-block j: qs bytes 32*(j/2) .. +31, low nibble for even j, high for odd
    const uint4* qs = (const uint4*)(blk + Q4K_QS + 32 * (j >> 1));
    const uint4 q0 = qs[0], q1 = qs[1];
    const int shift = 4 * (j & 1);

    // get_scale_min_k4 on scales[12] = header bytes 4..15
    int sc, m;
    if (j < 4) {
        sc = byte_of(hdr, 4 + j) & 63;
        m = byte_of(hdr, 4 + j + 4) & 63;
    } else {
        sc = (byte_of(hdr, 4 + j + 4) & 0xF) | ((byte_of(hdr, 4 + j - 4) >> 6) << 4);
        m = (byte_of(hdr, 4 + j + 4) >> 4) | ((byte_of(hdr, 4 + j) >> 6) << 4);
    }
    const float d = f16_to_f32((u16)(hdr.x & 0xFFFF));
    const float dmin = f16_to_f32((u16)(hdr.x >> 16));
    const float dl = __fmul_rn(d, (float)sc);
    const float ml = __fmul_rn(dmin, (float)m);

    const u32 words[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    u32 h[16];                                               // 32 f16 outputs
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const u32 nib = (words[k] >> shift) & 0x0F0F0F0Fu;   // 4 elements 4k..4k+3
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
            v[e] = __fsub_rn(__fmul_rn(dl, (float)((nib >> (8 * e)) & 0xF)), ml);
        h[2 * k] = pack_f16x2(v[0], v[1]);
        h[2 * k + 1] = pack_f16x2(v[2], v[3]);
    }
    uint4* dst = (uint4*)(y + b * QK_K + 32 * j);            // 64 B, 16-aligned
#pragma unroll
    for (int s = 0; s < 4; ++s) dst[s] = make_uint4(h[4 * s], h[4 * s + 1], h[4 * s + 2], h[4 * s + 3]);
}

// q6_K element e (0..255) of a super-block (ggml dequantize_row_q6_K):
//   half n = e/128, c4 = (e%128)/32, l = e%32
//   ql byte 64n + 32*(c4&1) + l, nibble (c4>>1);  qh byte 32n + l, bits 2*c4..2*c4+1
//   scale index e/16
// One thread per 16 outputs c*16 .. c*16+15 (c = 0..15), so one ql, one qh run
// of 16 bytes and one scale.

// q6_K padded (224 B stride) -> f16.  w: (n_out, n_in/256*224) u8,
// y: (n_out, n_in) f16 bits, n_grp = n_out*n_in/16
extern "C" __global__ void __launch_bounds__(256)
dequant_q6k_f16(const u8* __restrict__ w, u16* __restrict__ y, long long n_grp) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_grp) return;
    const long long b = i >> 4;
    const int c = (int)(i & 15);
    const int n = c >> 3, c4 = (c >> 1) & 3, l0 = 16 * (c & 1);
    const u8* blk = w + b * Q6K_PADDED;                      // 224 = 14*16: aligned
    const uint4 ql = *(const uint4*)(blk + 64 * n + 32 * (c4 & 1) + l0);
    const uint4 qh = *(const uint4*)(blk + Q6K_QH + 32 * n + l0);
    const float d = load_f16(blk + Q6K_D);
    const float ds = __fmul_rn(d, (float)(i8)blk[Q6K_SC + c]);
    const int sl = 4 * (c4 >> 1), sh = 2 * c4;

    const u32 lw[4] = {ql.x, ql.y, ql.z, ql.w}, hw[4] = {qh.x, qh.y, qh.z, qh.w};
    u32 h[8];                                                // 16 f16 outputs
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int q = (((lw[k] >> (8 * e + sl)) & 0xF) | (((hw[k] >> (8 * e + sh)) & 3) << 4)) - 32;
            v[e] = __fmul_rn(ds, (float)q);
        }
        h[2 * k] = pack_f16x2(v[0], v[1]);
        h[2 * k + 1] = pack_f16x2(v[2], v[3]);
    }
    uint4* dst = (uint4*)(y + b * QK_K + 16 * c);            // 32 B, 16-aligned
    dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
    dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
}

// q6_K from the W_exp plane (seed §2.3: dense centered int8 (ql|qh<<4)-32, row
// stride n_in, super-block stride 256) with d and the scales from the padded
// blocks -> f16. Flattened, plane element b*256 + e is super-block b's element e.
// w: padded (n_out, n_in/256*224) u8, wexp: (n_out, n_in) i8,
// y: (n_out, n_in) f16 bits, n_grp = n_out*n_in/16
extern "C" __global__ void __launch_bounds__(256)
dequant_q6k_exp_f16(const u8* __restrict__ w, const i8* __restrict__ wexp,
                    u16* __restrict__ y, long long n_grp) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_grp) return;
    const long long b = i >> 4;
    const int c = (int)(i & 15);
    const u8* blk = w + b * Q6K_PADDED;
    const uint4 qv = *(const uint4*)(wexp + b * QK_K + 16 * c);   // 16 int8
    const float d = load_f16(blk + Q6K_D);
    const float ds = __fmul_rn(d, (float)(i8)blk[Q6K_SC + c]);

    const u32 qw[4] = {qv.x, qv.y, qv.z, qv.w};
    u32 h[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = __fmul_rn(ds, (float)(i8)((qw[k] >> (8 * e)) & 0xFF));
        h[2 * k] = pack_f16x2(v[0], v[1]);
        h[2 * k + 1] = pack_f16x2(v[2], v[3]);
    }
    uint4* dst = (uint4*)(y + b * QK_K + 16 * c);
    dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
    dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
}

// x (n,) f32 -> y (n,) f16 bits, RNE; n4 = n/4 (4 elements per thread: 16 B in, 8 B out).
// Activations before the GEMM, and K/V into the f16 cache (y offset by pos0 rows).
extern "C" __global__ void __launch_bounds__(256)
cast_f32_f16(const float4* __restrict__ x, uint2* __restrict__ y, long long n4) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        const float4 v = x[i];
        y[i] = make_uint2(pack_f16x2(v.x, v.y), pack_f16x2(v.z, v.w));
    }
}

#ifdef MINFER_SASS_INSTANTIATE
// All kernels here are plain extern "C" (no templates): compiling the file
// (nvcc -arch=sm_90 -c -Xptxas -v) already emits SASS for each of them.
#endif
