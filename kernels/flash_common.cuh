// What the two prefill flash attentions (flash_attn.cu: mma.sync, any sm_80+;
// flash_attn_sm90.cu: wgmma, Hopper) share: the softmax's arithmetic, so that
// the same scores give the same probabilities in both.
#pragma once

#define FA_NEG_INF (-__int_as_float(0x7f800000))

// f32 pair -> f16x2 (RNE) in one instruction, lo in the low half (= the lower k index)
__device__ __forceinline__ u32 fa_pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x on the MUFU (flushes results below 2^-126 to 0: those probabilities are
// negligible next to the row's largest, which is 1); 2^-inf = 0
__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
