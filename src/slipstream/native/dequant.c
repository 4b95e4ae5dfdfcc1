/* GGUF blocks of the legacy 32-element formats (Q4_0, Q4_1, Q8_0) to float16 or float32: the
 * dense weights a CPU prefill multiplies (quant.dequantize_as; weights/linear.py's
 * LazyDenseLinear makes them after the load).
 *
 * Why: in torch ops (quant/legacy.py: nibbles widened to float32, the multiply and the add
 * each a pass, then a narrowing copy) the default model's 106M layer weights took about 0.7 s
 * of one core, which the first token of a `run` waited for on a 2-core machine. Here each
 * weight is made in one pass from its block.
 *
 * The bits are quant/legacy.py's, whose float operations mirror gguf-py's: in float32,
 *     Q4_0: (q - 8) * d      Q4_1: q * d + m      Q8_0: q * d
 * (d and m the block's float16 fields widened exactly, q - 8 exact, each product and sum
 * rounded once: this file is built with -ffp-contract=off, so no fused multiply-add), then
 * rounded once to float16 to nearest even (half.h) where float16 is asked for. */

#include <stdint.h>
#include <string.h>

#include "half.h"

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define DQ_F16C 1  /* 8 floats to float16 in one instruction, rounded as f32_to_f16 rounds */
#else
#define DQ_F16C 0
#endif

enum { DQ_Q4_0 = 0, DQ_Q4_1 = 1, DQ_Q8_0 = 2 };

/* One block's 32 float32 weights. */
static inline void dq_block(const uint8_t *b, int fmt, float *w) {
    if (fmt == DQ_Q8_0) {
        const float d = f16_to_f32((uint16_t)(b[0] | (b[1] << 8)));
        for (int i = 0; i < 32; i++) w[i] = (float)(int8_t)b[2 + i] * d;
        return;
    }
    const float d = f16_to_f32((uint16_t)(b[0] | (b[1] << 8)));
    if (fmt == DQ_Q4_0) {
        const uint8_t *qs = b + 2;
        for (int i = 0; i < 16; i++) {
            w[i] = (float)((int)(qs[i] & 0x0f) - 8) * d;
            w[i + 16] = (float)((int)(qs[i] >> 4) - 8) * d;
        }
        return;
    }
    const float m = f16_to_f32((uint16_t)(b[2] | (b[3] << 8)));
    const uint8_t *qs = b + 4;
    for (int i = 0; i < 16; i++) {
        w[i] = (float)(qs[i] & 0x0f) * d + m;
        w[i + 16] = (float)(qs[i] >> 4) * d + m;
    }
}

/* Blocks [0, n) of `fmt` (block_bytes each, end to end at raw) into out: n * 32 float16
 * (out_f16) or float32 values, in order. Blocks are shared out over `threads` OpenMP
 * threads; each value is made by one thread from its own block, so any count gives the same
 * bits. */
void ss_dequant_blocks(const uint8_t *raw, int fmt, int64_t n, void *out, int out_f16,
                       int threads) {
    const int64_t bytes = fmt == DQ_Q8_0 ? 34 : (fmt == DQ_Q4_1 ? 20 : 18);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < n; k++) {
        float w[32];
        dq_block(raw + k * bytes, fmt, w);
        if (out_f16) {
            uint16_t *o = (uint16_t *)out + k * 32;
#if DQ_F16C
            /* IEEE round to nearest even, NaNs kept quiet with their sign: f32_to_f16's bits
             * (the conversion dominated the pass in plain C) */
            for (int i = 0; i < 32; i += 8)
                _mm_storeu_si128((__m128i *)(o + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(w + i), _MM_FROUND_TO_NEAREST_INT));
#else
            for (int i = 0; i < 32; i++) o[i] = f32_to_f16(w[i]);
#endif
        } else {
            memcpy((float *)out + k * 32, w, sizeof w);
        }
    }
}
