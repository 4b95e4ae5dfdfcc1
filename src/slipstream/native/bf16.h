/* bfloat16 <-> float32 as torch converts them, for the native decode sources. */
#ifndef SS_BF16_H
#define SS_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* torch's float -> bfloat16: round to nearest even, NaN to a quiet NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Row r of x (rows of k values: float32 where x_f32, else bfloat16) as float32: the row itself,
 * or its widened copy in xf (k floats, one buffer the rows share, each used before the next). */
static inline const float *row_as_f32(const void *x, int64_t r, int64_t k, int x_f32,
                                      float *xf) {
    if (x_f32) return (const float *)x + r * k;
    const uint16_t *xb = (const uint16_t *)x + r * k;
    for (int64_t i = 0; i < k; i++) xf[i] = bf16_to_f32(xb[i]);
    return xf;
}

#endif
