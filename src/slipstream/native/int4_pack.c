/* GGUF 4-bit rows (Q4_0, Q4_1, Q4_K) straight into torch's int4 CPU layout and its bfloat16
 * scale/zero plane: the load-time packing of int4pack linears (weights/cpu/torch_kernels.py,
 * Int4PackLinear.from_raws), hybrid decode's CPU share above all.
 *
 * Why: the same packing in torch ops takes a dozen small calls per 64 rows (codes, int32
 * widening, float64 scale and zero, the rounding to bfloat16, the packer). On the H200 host a
 * 70B's 7.7 GB of CPU share took about 100 s that way on 15 threads, which made a hybrid load
 * 4x a plain one. Here each call is one pass over
 * its rows, writes only into the caller's tensors, and holds no lock: the Python pool's threads
 * (ctypes releases the GIL) run side by side.
 *
 * torch's convention: w = (u - 8) * s + z with u in [0, 15], per 32-column group:
 *     Q4_0 (d | qs[16]):          w = d (q - 8)            u = q, s = d, z = 0
 *     Q4_1 (d | m | qs[16]):      w = d q + m              u = q, s = d, z = 8 d + m
 *     Q4_K (d | dmin | sc[12] | qs[128]), sub-block j: w = d sc_j q - dmin m_j
 *                                                          u = q, s = d sc_j, z = 8 s - dmin m_j
 * s and z are exact in double (f16 times 6-bit integers and their sums) and rounded once to
 * bfloat16, to nearest even: the same bits as weights/cpu/groups.py's bf16_nearest.
 *
 * Layout (torch's weight_to_int4pack for CPU, `block` rows at a time: 64 with AVX-512, 32 with
 * AVX2): row n, column k of a block is a nibble of byte k * block / 2 + n % (block / 2), the
 * low one for the first half of the block's rows and the high one for the second. The caller
 * checks the layout against torch's own packer once per process (torch_kernels.native_block)
 * and passes `block`; rows here are whole blocks.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { FMT_Q4_0 = 0, FMT_Q4_1 = 1, FMT_Q4_K = 2 };

static double f16_to_double(uint16_t h) {
    /* exact; built from the bits (no libm call: this runs for every group) */
    uint64_t sign = (uint64_t)(h & 0x8000) << 48;
    int exp = (h >> 10) & 0x1f;
    uint64_t man = h & 0x3ff;
    double v;
    if (exp == 0) {
        v = (double)man * 0x1p-24;  /* subnormal (or zero): exact */
        return (h & 0x8000) ? -v : v;
    }
    uint64_t bits = exp == 31 ? (sign | 0x7ff0000000000000ull | (man << 42))
                              : (sign | ((uint64_t)(exp - 15 + 1023) << 52) | (man << 42));
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* double -> bfloat16 bits, rounded once to nearest even (bfloat16 keeps float32's exponent
 * range: 8 significant bits, subnormals on a 2^-133 grid). */
static uint16_t bf16_slow(double v) {
    if (isnan(v)) return 0x7fc0;
    uint16_t sign = signbit(v) ? 0x8000 : 0;
    double a = fabs(v);
    if (a == 0.0) return sign;
    int e;
    frexp(a, &e);  /* a = m 2^e, m in [0.5, 1) */
    int q = e - 8 > -133 ? e - 8 : -133;  /* the exponent of the last kept bit */
    double r = ldexp(nearbyint(ldexp(a, -q)), q);  /* exact steps; nearbyint: half to even */
    if (r >= 0x1p128) return sign | 0x7f80;  /* overflow: infinity */
    float f = (float)r;  /* exact: r has at most 8 significant bits */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return sign | (uint16_t)(bits >> 16);
}

static inline uint16_t bf16_nearest(double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    int exp = (int)((bits >> 52) & 0x7ff);
    /* float32's normal range, with room for the rounding's carry: round the 52-bit mantissa
     * to 7 bits (half to even) on the bits themselves */
    if (exp > 1023 - 126 && exp < 1023 + 127) {
        uint64_t r = (bits + ((1ull << 44) - 1) + ((bits >> 45) & 1)) >> 45;  /* s|e11|m7 */
        uint64_t e = ((r >> 7) & 0x7ff) - 1023 + 127, m = r & 0x7f;
        return (uint16_t)(((bits >> 48) & 0x8000) | (e << 7) | m);
    }
    return bf16_slow(v);
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* One 32-column group's codes u[32], from block bytes `b`, group `g` of the format's block
 * (Q4_K: 8 groups per block), and the fields its weights are made of: Q4_K's d, the group's
 * 6-bit scale sj, dmin and its 6-bit min mj; Q4_0's and Q4_1's d (sj 1), and Q4_1's m in dmin
 * (mj 1; Q4_0: 0). */
static void group_fields(const uint8_t *b, int fmt, int g, uint8_t *u, double *d, int *sj,
                         double *dmin, int *mj) {
    if (fmt == FMT_Q4_K) {
        const uint8_t *sc = b + 4, *qs = b + 16 + 32 * (g / 2);
        *d = f16_to_double(rd16(b));
        *dmin = f16_to_double(rd16(b + 2));
        if (g < 4) {
            *sj = sc[g] & 63;
            *mj = sc[g + 4] & 63;
        } else {
            *sj = (sc[g + 4] & 0x0f) | ((sc[g - 4] >> 6) << 4);
            *mj = (sc[g + 4] >> 4) | ((sc[g] >> 6) << 4);
        }
        int shift = (g & 1) ? 4 : 0;  /* sub-block 2i in the low nibbles, 2i + 1 in the high */
        for (int i = 0; i < 32; i++) u[i] = (qs[i] >> shift) & 0x0f;
        return;
    }
    const uint8_t *qs = b + (fmt == FMT_Q4_1 ? 4 : 2);
    for (int i = 0; i < 16; i++) {
        u[i] = qs[i] & 0x0f;
        u[i + 16] = qs[i] >> 4;
    }
    *d = f16_to_double(rd16(b));
    *sj = 1;
    *dmin = fmt == FMT_Q4_1 ? f16_to_double(rd16(b + 2)) : 0.0;
    *mj = fmt == FMT_Q4_1 ? 1 : 0;
}

/* torch's int4 convention for the group: its codes u[32], scale and zero (above). */
static void group_of(const uint8_t *b, int fmt, int g, uint8_t *u, double *s, double *z) {
    double d, dmin;
    int sj, mj;
    group_fields(b, fmt, g, u, &d, &sj, &dmin, &mj);
    if (fmt == FMT_Q4_K) {
        *s = d * sj;
        *z = 8.0 * *s - dmin * mj;
        return;
    }
    *s = d;
    *z = fmt == FMT_Q4_1 ? 8.0 * d + dmin : 0.0 * d;  /* -0 as torch */
}

/* Rows [0, rows) of a matrix of `fmt` (row r's bytes at raw + r * row_bytes; its columns
 * [0, cols), cols a multiple of the format's block) into
 *   packed: the layout above, rows counted from `row0` (a multiple of `block`) of a matrix
 *           whose packed rows are cols / 2 bytes;
 *   sz:     bfloat16 (cols / 32, padded_rows, 2): (group, row0 + r) -> scale, zero.
 * rows must be a multiple of `block` (at most 64). A block's group of 32 columns is decoded
 * into a tile, whose bytes then go out in one contiguous run of 16 block bytes. Blocks are
 * shared out over `threads` OpenMP threads (1 from a pool that is the parallelism itself). */
void ss_int4pack_rows(const uint8_t *raw, int64_t row_bytes, int fmt, int64_t rows,
                      int64_t cols, int64_t row0, int64_t padded_rows, int64_t block,
                      uint8_t *packed, uint16_t *sz, int threads) {
    const int64_t bsize = fmt == FMT_Q4_K ? 144 : (fmt == FMT_Q4_1 ? 20 : 18);
    const int per_block = fmt == FMT_Q4_K ? 8 : 1;  /* 32-column groups per format block */
    const int64_t groups = cols / 32, half = block / 2, blocks = rows / block;
    if (block > 64 || block % 2) return;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t tile[64][32];
        const int64_t n0 = row0 + b * block;  /* the block's first row in the stacked matrix */
        uint8_t *out = packed + (n0 / block) * block * (cols / 2);
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t i = 0; i < block; i++) {
                double s, z;
                const uint8_t *row = raw + (b * block + i) * row_bytes;
                group_of(row + (g / per_block) * bsize, fmt, (int)(g % per_block), tile[i],
                         &s, &z);
                uint16_t *o = sz + (g * padded_rows + n0 + i) * 2;
                o[0] = bf16_nearest(s);
                o[1] = bf16_nearest(z);
            }
            uint8_t *p = out + g * 32 * half;  /* column k's byte d: p[k * half + d] */
            for (int k = 0; k < 32; k++)
                for (int64_t d = 0; d < half; d++)
                    p[k * half + d] = (uint8_t)(tile[d][k] | (tile[d + half][k] << 4));
        }
    }
}

/* ------------------------------------------------------------------------------------------
 * The same GGUF 4-bit rows into q4vnni's records (weights/cpu/vnni.py, Q4VnniLinear: the
 * layout q4_matvec.c reads), for the same reason: in torch ops the unpacking and the permute
 * are a dozen calls per chunk of rows, and a 70B's hybrid load with q4vnni took 70-85 s
 * against int4pack's 25-34 s on an H100 host.
 *
 * q4vnni's convention: w = s u + z, u in [0, 15], in float32 as the torch path forms it:
 *     Q4_0: s = d, z = -8 d;  Q4_1: s = d, z = 0 s + m;  Q4_K: s = d sc_j, z = 0 s - dmin m_j
 * (0 s: the torch path's lo * s, kept for its signed zeros). A record holds 16 rows x 32
 * columns: its first 256 bytes are the codes, row r's columns 4j..4j+3 at bytes
 * (j % 4) * 64 + 4r .. + 3, in the low nibble for j < 4 and the high one for j >= 4; the scale
 * and zero planes after them are the caller's (written from s_out and z_out). */
static void vnni_group_of(const uint8_t *b, int fmt, int g, uint8_t *u, float *s, float *z) {
    double d, dmin;
    int sj, mj;
    group_fields(b, fmt, g, u, &d, &sj, &dmin, &mj);
    if (fmt == FMT_Q4_K) {
        *s = (float)d * (float)sj;
        *z = 0.0f * *s + -((float)dmin * (float)mj);
    } else {
        *s = (float)d;
        *z = fmt == FMT_Q4_1 ? 0.0f * *s + (float)dmin : -8.0f * *s;
    }
}

/* Rows [0, rows) of a matrix of `fmt` (row r at raw + r * row_bytes, columns [0, cols)) as
 * rows row0.. of a stacked q4vnni weight: codes into `packed` (records of `record_bytes`,
 * cols / 32 of them per 16-row block), s and z into float32 (padded_rows, cols / 32) planes.
 * Rows are shared out over `threads` OpenMP threads; each writes only its own bytes, so a
 * record may hold rows of two parts (a part's rows need not be a multiple of 16). */
void ss_q4vnni_rows(const uint8_t *raw, int64_t row_bytes, int fmt, int64_t rows, int64_t cols,
                    int64_t row0, uint8_t *packed, int64_t record_bytes, float *s_out,
                    float *z_out, int threads) {
    const int64_t bsize = fmt == FMT_Q4_K ? 144 : (fmt == FMT_Q4_1 ? 20 : 18);
    const int per_block = fmt == FMT_Q4_K ? 8 : 1;
    const int64_t groups = cols / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = raw + r * row_bytes;
        const int64_t n = row0 + r, rr = n % 16;
        uint8_t *rec = packed + (n / 16) * groups * record_bytes;
        for (int64_t g = 0; g < groups; g++) {
            uint8_t u[32];
            vnni_group_of(row + (g / per_block) * bsize, fmt, (int)(g % per_block), u,
                          s_out + n * groups + g, z_out + n * groups + g);
            uint8_t *p = rec + g * record_bytes + 4 * rr;
            for (int jm = 0; jm < 4; jm++)
                for (int t = 0; t < 4; t++)
                    p[jm * 64 + t] = (uint8_t)(u[jm * 4 + t] | (u[16 + jm * 4 + t] << 4));
        }
    }
}

/* ------------------------------------------------------------------------------------------
 * Q8_0 rows (d | qs[32] per 32 columns: w = d q) into q8vnni's records (weights/cpu/vnni.py,
 * Q8VnniLinear; q4_matvec.c's Q8_F16), for the same reason: in torch ops the widening, the
 * +128 and the permute of the default model's tied 49152 x 576 head took 0.24 s, paid by the
 * first generated token (the head is packed at its first one-row call).
 *
 * A record holds 16 rows x 32 columns: 512 bytes of codes, row r's columns 4j..4j+3 at bytes
 * 64 j + 4 r .. + 3 as u = q + 128 (unsigned, for vpdpbusd), then the 16 rows' d as the file's
 * float16 bits (w = d u - 128 d: Q8_0's weights exactly). Rows [0, rows) of the part go to
 * rows row0.. of the stacked weight; padding rows are the caller's (zeros). Rows are shared
 * out over `threads` OpenMP threads, each writing only its own bytes. */
void ss_q8vnni_rows(const uint8_t *raw, int64_t row_bytes, int64_t rows, int64_t cols,
                    int64_t row0, uint8_t *packed, int threads) {
    const int64_t groups = cols / 32, record_bytes = 512 + 2 * 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = raw + r * row_bytes;
        const int64_t n = row0 + r, rr = n % 16;
        uint8_t *rec = packed + (n / 16) * groups * record_bytes;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *b = row + g * 34;  /* d (2 bytes) | qs[32] (int8) */
            uint8_t *p = rec + g * record_bytes;
            for (int j = 0; j < 8; j++)
                for (int t = 0; t < 4; t++)
                    p[64 * j + 4 * rr + t] = (uint8_t)(b[2 + 4 * j + t] ^ 0x80);  /* q + 128 */
            p[512 + 2 * rr] = b[0];
            p[512 + 2 * rr + 1] = b[1];
        }
    }
}
