// q6_K super-block groups to f16: the f16 engine's weight values, written by
// dequant_f16.cu's whole-weight dequantization and by gateup_sm90.cu's f16 kernel
// (weights dequantized beside its products, from copies in shared memory). One
// definition, so both write the same bits.
//
// q6_K element e (0..255) of a super-block (ggml dequantize_row_q6_K):
//   half n = e/128, c4 = (e%128)/32, l = e%32
//   q = (ql[64n + 32*(c4&1) + l] >> 4*(c4>>1)) & 0xF | ((qh[32n + l] >> 2*c4) & 3) << 4
//   value d * scales[e/16] * (q - 32)
// Group c (0..15) of a super-block is the 8-element chunks c and c + 16 (elements
// 8c.. and 128+8c..), as for q4_K (q4k_f16.cuh). Chunk c (half 0): c4 = c/4,
// l = 8*(c%4) + 0..7, scale c/2. Chunk c+16 (half 1): the same with ql + 64,
// qh + 32, scale 8 + c/2. Each value is the f32 product d*sc, then times q, each
// rounded as NumPy rounds them (__fmul_rn: no contraction), then rounded to f16.
#pragma once

#include "common.cuh"
#include "q4k_f16.cuh"

// group c = i % 16 of the padded super-block at blk (16-byte aligned) -> y (the
// weight's f16 form, row-major) at elements b*256 + 8c and + 128, b = i / 16
__device__ __forceinline__ void q6k_group_store_at(const u8* blk, u16* __restrict__ y, long long i) {
    const int c = (int)(i & 15);
    const int c4 = c >> 2, l0 = 8 * (c & 3);
    const int ql_off = 32 * (c4 & 1) + l0;
    const uint2 ql_a = *(const uint2*)(blk + ql_off);        // half 0
    const uint2 ql_b = *(const uint2*)(blk + ql_off + 64);   // half 1
    const uint2 qh_a = *(const uint2*)(blk + Q6K_QH + l0);
    const uint2 qh_b = *(const uint2*)(blk + Q6K_QH + l0 + 32);
    const float d = load_f16(blk + Q6K_D);
    const float ds_a = __fmul_rn(d, (float)(i8)blk[Q6K_SC + (c >> 1)]);
    const float ds_b = __fmul_rn(d, (float)(i8)blk[Q6K_SC + 8 + (c >> 1)]);
    const int sl = 4 * (c4 >> 1), shh = 2 * c4;

    float va[8], vb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int bit = 8 * (k & 3);
        const int qa = ((((k < 4 ? ql_a.x : ql_a.y) >> (bit + sl)) & 0xF) |
                        ((((k < 4 ? qh_a.x : qh_a.y) >> (bit + shh)) & 3) << 4)) - 32;
        const int qb = ((((k < 4 ? ql_b.x : ql_b.y) >> (bit + sl)) & 0xF) |
                        ((((k < 4 ? qh_b.x : qh_b.y) >> (bit + shh)) & 3) << 4)) - 32;
        va[k] = __fmul_rn(ds_a, (float)qa);
        vb[k] = __fmul_rn(ds_b, (float)qb);
    }
    u16* dst = y + (i >> 4) * QK_K + 8 * c;
    store8_f16(dst, va);
    store8_f16(dst + 128, vb);
}

// The same from the super-block's 256 W_exp plane bytes at pe (the centered int8
// (ql|qh<<4)-32, 16-byte aligned), d and the scales from the padded block at blk
__device__ __forceinline__ void q6k_exp_group_store_at(const u8* blk, const i8* pe, u16* __restrict__ y,
                                                       long long i) {
    const int c = (int)(i & 15);
    const uint2 pa = *(const uint2*)(pe + 8 * c);            // elements 8c..8c+7
    const uint2 pb = *(const uint2*)(pe + 8 * c + 128);      // elements 128+8c..
    const float d = load_f16(blk + Q6K_D);
    const float ds_a = __fmul_rn(d, (float)(i8)blk[Q6K_SC + (c >> 1)]);
    const float ds_b = __fmul_rn(d, (float)(i8)blk[Q6K_SC + 8 + (c >> 1)]);

    float va[8], vb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int bit = 8 * (k & 3);
        va[k] = __fmul_rn(ds_a, (float)(i8)(((k < 4 ? pa.x : pa.y) >> bit) & 0xFF));
        vb[k] = __fmul_rn(ds_b, (float)(i8)(((k < 4 ? pb.x : pb.y) >> bit) & 0xFF));
    }
    u16* dst = y + (i >> 4) * QK_K + 8 * c;
    store8_f16(dst, va);
    store8_f16(dst + 128, vb);
}
