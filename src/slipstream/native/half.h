/* float16 <-> float32 for the native sources, exactly (subnormals, infinities and NaNs
 * included), in plain C: the machines without F16C take the same bits as those with it. */
#ifndef SS_HALF_H
#define SS_HALF_H

#include <stdint.h>
#include <string.h>

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  /* subnormal: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> float16 bits, rounded to nearest even as IEEE 754 (and torch's casts) round:
 * overflow to infinity, float16's subnormals, a NaN kept a (quiet) NaN of the same sign. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu);  /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u;  /* 65520 and up round past 65504: inf */
    if (a >= 0x38800000u) {  /* a float16 normal: rebias the exponent, round 13 bits off */
        uint32_t r = a - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return sign | (uint16_t)(r >> 13);
    }
    /* below 2^-14: a count of float16's subnormal unit 2^-24 (the smallest normal where it
     * rounds up to 2^10 units). The value is m 2^(e - 150) for the 24-bit significand m and
     * biased exponent e, so m >> (126 - e) units, rounded on the bits shifted out. */
    const int shift = 126 - (int)(a >> 23);
    if (shift > 24) return sign;  /* under 2^-25: rounds to zero */
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t q = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

#endif
