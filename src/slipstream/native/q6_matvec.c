/* Q6_K weights times 16-bit-quantized activations: the CPU decode matmul of the q6vnni kind
 * (weights/cpu/q6vnni.py, Q6VnniLinear), the output head of most K-quant files above all.
 *
 * Why: torch's int8 kernel (int8pack) needs Q6_K requantized to int8 with one scale a row, 8
 * bits a weight plus the requantization's error, where the file holds 6.5625 exact bits; and it
 * multiplies in floats. On the 2-core AVX-512 EPYC a Qwen3-MoE head (151936 x 2048) took
 * about as long as the rest of a decode token through it. This loop reads Q6_K's own codes and
 * scales (the file's bytes, rearranged) and multiplies integers, as q4_matvec.c does.
 *
 * Math. Q6_K: a row's 256-column super-block has one float16 d and 16 int8 scales sc_j, one a
 * 16-column sub-block, and 6-bit codes u in [0, 63]: w = d sc_j (u - 32). The activations are
 * quantized as q4_matvec.c's (ss_q16_quantize_row: per block of 32, dx = max|x| / 32512,
 * X = round(x / dx), held as two int8 digits X = 256 hi + lo). Per sub-block the integer sum
 *     S_j = sum (u - 32) X = 256 (u . hi) + (u . lo) - 32 sum(X)
 * is exact in int32 and, since |u - 32| <= 32, |S_j| <= 32 * 32512 * 16 < 2^24, exact as a float
 * too. A row's output is then
 *     y = sum_j fma((S_j * dx_g), d sc_j, y)        (g: the activation block holding j)
 * sub-block after sub-block, in column order: d sc_j is a float16 times an 8-bit integer, exact
 * in float32, so the weights are the file's exactly; the activations' rounding (to 16 bits, as
 * q4vnni's) is the only error besides float32 sums. The generic loop and the VNNI one perform
 * the same float operations in the same order: the same bits.
 *
 * Layout (made by ss_q6vnni_rows): rows in blocks of 16 (the last one padded with zero rows),
 * each block's columns in runs of 256 (one Q6_K super-block), a run being
 *     header (320 bytes): d[16] (float16, row by row) | sc[16 sub-blocks][16 rows] (int8) |
 *                         32 bytes of zeros, so that every run starts on a 64-byte line
 *     8 groups of 32 columns, 384 bytes each:
 *         ql: 4 chunks of 64 bytes, q4_matvec.c's 4-bit layout: row r's codes of columns
 *             4j..4j+3 (quad j) are bytes 4r..4r+3 of chunk j % 4, low nibbles for j < 4, high
 *             ones for j >= 4 (each code's low 4 bits)
 *         qh: 2 chunks of 64 bytes: quad j's top 2 bits at bits 2 (j % 4)..2 (j % 4) + 1 of
 *             bytes 4r..4r+3 of chunk j / 4
 * 16 x 210 bytes a run, Q6_K's own 6.5625 bits a weight, plus the 32-byte pad: 6.625 bits. So a
 * 64-byte load and a mask give one quad's low bits for 16 rows (lane r: row r), another load,
 * shift and mask their high bits, and a vpdpbusd against 4 activation digits broadcast to every
 * lane advances 16 rows by 4 columns; quads 0-3 are one sub-block, 4-7 the next.
 *
 * Threads: row blocks split over OpenMP threads as q4_matvec.c's (parallel.h); each output is
 * computed by one thread in one order, so a row's bits do not depend on the thread count or on
 * the other rows of its call.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "half.h"
#include "parallel.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q6_VNNI 1
#include <immintrin.h>
#else
#define Q6_VNNI 0
#endif

#define Q6_ROWS 16        /* rows per block: one 32-bit lane of a 512-bit vector each */
#define Q6_GROUP 32       /* columns per activation block (dx) */
#define Q6_SUB 16         /* columns per Q6_K scale */
#define Q6_RUN 256        /* columns per Q6_K super-block: one run */
#define Q6_GROUPS_PER_RUN (Q6_RUN / Q6_GROUP)
#define Q6_HEADER 320     /* d[16] f16 (32) | sc[16][16] int8 (256) | pad (32) */
#define Q6_SC_OFFSET 32
#define Q6_GROUP_BYTES 384  /* ql (256) | qh (128) */
#define Q6_RUN_BYTES (Q6_HEADER + Q6_GROUPS_PER_RUN * Q6_GROUP_BYTES)
#define Q6_MAX_M 4        /* activation rows multiplied per pass over the weights */
#define Q6K_BLOCK_BYTES 210  /* the file's Q6_K block: ql[128] | qh[64] | sc[16] | d */

/* q4_matvec.c's activation quantization: X = 256 hi + lo per block of 32, dx, sx. */
void ss_q16_quantize_row(const float *x, int64_t k, int8_t *hi, int8_t *lo, float *dx,
                         float *sx);

/* --- packing ------------------------------------------------------------------------------ */

/* One file block's 256 codes u in [0, 63] (ggml's dequantize_row_q6_K order). */
static void q6k_codes(const uint8_t *b, uint8_t *u) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int half = 0; half < 2; half++) {
        for (int l = 0; l < 32; l++) {
            uint8_t h = qh[l];
            u[l] = (uint8_t)((ql[l] & 0x0f) | ((h & 3) << 4));
            u[l + 32] = (uint8_t)((ql[l + 32] & 0x0f) | (((h >> 2) & 3) << 4));
            u[l + 64] = (uint8_t)((ql[l] >> 4) | (((h >> 4) & 3) << 4));
            u[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4));
        }
        u += 128;
        ql += 64;
        qh += 32;
    }
}

/* Rows [0, rows) of a Q6_K matrix (row_bytes apart, cols a multiple of 256) into rows
 * [row0, row0 + rows) of the packed weight (ceil(total / 16) blocks of cols / 256 runs), whose
 * bytes the caller zeroed where padding rows fall. Blocks split over `threads`. */
void ss_q6vnni_rows(const uint8_t *raw, int64_t row_bytes, int64_t rows, int64_t cols,
                    int64_t row0, uint8_t *packed, int threads) {
    const int64_t runs = cols / Q6_RUN, block_bytes = runs * Q6_RUN_BYTES;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
#endif
    for (int64_t i = 0; i < rows; i++) {
        const int64_t row = row0 + i, r = row % Q6_ROWS;
        uint8_t *blk = packed + (row / Q6_ROWS) * block_bytes;
        uint8_t u[Q6_RUN];
        for (int64_t t = 0; t < runs; t++) {
            const uint8_t *b = raw + i * row_bytes + t * Q6K_BLOCK_BYTES;
            uint8_t *run = blk + t * Q6_RUN_BYTES;
            memcpy(run + 2 * r, b + 208, 2);  /* d */
            if (r == 0) memset(run + Q6_HEADER - 32, 0, 32);  /* the pad (each block has a row 0) */
            for (int j = 0; j < Q6_RUN / Q6_SUB; j++) run[Q6_SC_OFFSET + j * Q6_ROWS + r] = b[192 + j];
            q6k_codes(b, u);
            for (int g = 0; g < Q6_GROUPS_PER_RUN; g++) {
                uint8_t *p = run + Q6_HEADER + g * Q6_GROUP_BYTES;
                for (int c = 0; c < Q6_GROUP; c++) {
                    const int j = c / 4, tt = c % 4;
                    const uint8_t v = u[g * Q6_GROUP + c];
                    uint8_t *lo = p + 64 * (j & 3) + 4 * r + tt;
                    uint8_t *hi = p + 256 + 64 * (j >> 2) + 4 * r + tt;
                    if (j < 4) *lo = (uint8_t)((*lo & 0xf0) | (v & 0x0f));
                    else *lo = (uint8_t)((*lo & 0x0f) | ((v & 0x0f) << 4));
                    *hi = (uint8_t)((*hi & ~(3 << (2 * (j & 3)))) | ((v >> 4) << (2 * (j & 3))));
                }
            }
        }
    }
}

/* --- the product --------------------------------------------------------------------------- */

/* Code t (0..3) of quad j of row i in a group's bytes p: u in [0, 63]. */
static inline int q6_code(const uint8_t *p, int i, int j, int t) {
    int low = (p[64 * (j & 3) + 4 * i + t] >> (4 * (j >> 2))) & 0x0f;
    int high = (p[256 + 64 * (j >> 2) + 4 * i + t] >> (2 * (j & 3))) & 3;
    return low | high << 4;
}

/* The outputs of one 16-row block for M activation rows: out[r * 16 + i].
 * q: M rows of 2 k int8 digits (high then low); dx: M rows of k / 32; sxi: M rows of k / 16
 * integer sums of X. */
static inline __attribute__((always_inline)) void q6_block_generic(
        const uint8_t *blk, int64_t k, const int8_t *q, const float *dx, const int32_t *sxi,
        float *out, const int M) {
    float acc[Q6_MAX_M][Q6_ROWS];
    memset(acc, 0, sizeof acc);
    const int64_t G = k / Q6_GROUP;
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *run = blk + (g / Q6_GROUPS_PER_RUN) * Q6_RUN_BYTES;
        const uint8_t *p = run + Q6_HEADER + (g % Q6_GROUPS_PER_RUN) * Q6_GROUP_BYTES;
        for (int h = 0; h < 2; h++) {  /* the group's two sub-blocks */
            const int64_t sub = 2 * g + h;
            const int8_t *sc = (const int8_t *)run + Q6_SC_OFFSET + (sub % 16) * Q6_ROWS;
            for (int r = 0; r < M; r++) {
                const int8_t *xh = q + r * 2 * k + g * Q6_GROUP, *xl = xh + k;
                for (int i = 0; i < Q6_ROWS; i++) {
                    int32_t hs = 0, ls = 0;
                    for (int j = 4 * h; j < 4 * h + 4; j++)
                        for (int t = 0; t < 4; t++) {
                            int c = q6_code(p, i, j, t);
                            hs += c * xh[4 * j + t];
                            ls += c * xl[4 * j + t];
                        }
                    int32_t s = hs * 256 + ls - 32 * sxi[r * (k / Q6_SUB) + sub];
                    uint16_t dh;
                    memcpy(&dh, run + 2 * i, 2);
                    float w = f16_to_f32(dh) * (float)sc[i];
                    acc[r][i] = fmaf((float)s * dx[r * G + g], w, acc[r][i]);
                }
            }
        }
    }
    for (int r = 0; r < M; r++) memcpy(out + r * Q6_ROWS, acc[r], sizeof acc[r]);
}

/* Software prefetches, in runs ahead of the one being read: into L1 (Q6_PREFETCH_NEAR_RUNS)
 * and L2 (Q6_PREFETCH_FAR_RUNS); 0: none. On the 2-core AVX-512 EPYC, half a Qwen3-MoE head
 * (75968 x 2048, 128 MB) on one thread, the variants interleaved in one process under a load
 * average of 6-7: no prefetch 9.0-10.1 ms at best (p25 15-18), one run into L1 13.8-19.9, two
 * 11.4-17.2, one into L1 and 4 into L2 (q4_matvec.c's Q4_KS distances) 42.5: the hardware's
 * prefetcher alone follows the sequential stream best. Build-time settings
 * (SLIPSTREAM_NATIVE_DEFINES), as q4_matvec.c's, for hosts where it may differ. */
#ifndef Q6_PREFETCH_NEAR_RUNS
#define Q6_PREFETCH_NEAR_RUNS 0
#endif
#ifndef Q6_PREFETCH_FAR_RUNS
#define Q6_PREFETCH_FAR_RUNS 0
#endif

#if Q6_VNNI
/* q6_block_generic with VNNI: the same sums and the same float operations, 16 rows a vector. */
static inline __attribute__((always_inline)) void q6_block_vnni(
        const uint8_t *blk, int64_t k, const int8_t *q, const float *dx, const int32_t *sxi,
        float *out, const int M) {
    __m512 acc[Q6_MAX_M];
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    const int64_t G = k / Q6_GROUP, S = k / Q6_SUB;
    __m512 d = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int gr = (int)(g % Q6_GROUPS_PER_RUN);
        const uint8_t *run = blk + (g / Q6_GROUPS_PER_RUN) * Q6_RUN_BYTES;
        const uint8_t *p = run + Q6_HEADER + gr * Q6_GROUP_BYTES;
        if (gr == 0) {
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)run));
            const char *near = (const char *)run + Q6_PREFETCH_NEAR_RUNS * Q6_RUN_BYTES;
            if (Q6_PREFETCH_NEAR_RUNS > 0)
                for (int o = 0; o < Q6_HEADER; o += 64) _mm_prefetch(near + o, _MM_HINT_T0);
        }
        {   /* this group's bytes Q6_PREFETCH_NEAR_RUNS on (L1), Q6_PREFETCH_FAR_RUNS on (L2) */
            const char *near = (const char *)p + Q6_PREFETCH_NEAR_RUNS * Q6_RUN_BYTES;
            if (Q6_PREFETCH_NEAR_RUNS > 0)
                for (int o = 0; o < Q6_GROUP_BYTES; o += 64) _mm_prefetch(near + o, _MM_HINT_T0);
            if (Q6_PREFETCH_FAR_RUNS > 0) {
                const char *far = (const char *)p + Q6_PREFETCH_FAR_RUNS * Q6_RUN_BYTES;
                for (int o = 0; o < Q6_GROUP_BYTES; o += 64) _mm_prefetch(far + o, _MM_HINT_T1);
                if (gr == 0)
                    for (int o = 0; o < Q6_HEADER; o += 64)
                        _mm_prefetch(far - Q6_HEADER + o, _MM_HINT_T1);
            }
        }
        __m512i u[8];
        for (int c = 0; c < 4; c++) {
            __m512i v = _mm512_loadu_si512((const void *)(p + 64 * c));
            u[c] = _mm512_and_si512(v, low);
            u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        for (int h = 0; h < 2; h++) {  /* each quad's top 2 bits to bits 4-5 */
            __m512i v = _mm512_loadu_si512((const void *)(p + 256 + 64 * h));
            u[4 * h + 0] = _mm512_or_si512(u[4 * h + 0], _mm512_and_si512(_mm512_slli_epi16(v, 4), top));
            u[4 * h + 1] = _mm512_or_si512(u[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(v, 2), top));
            u[4 * h + 2] = _mm512_or_si512(u[4 * h + 2], _mm512_and_si512(v, top));
            u[4 * h + 3] = _mm512_or_si512(u[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(v, 2), top));
        }
        for (int h = 0; h < 2; h++) {
            const int64_t sub = 2 * g + h;
            const int8_t *scp = (const int8_t *)run + Q6_SC_OFFSET + (sub % 16) * Q6_ROWS;
            __m512 w = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)scp))));
            for (int r = 0; r < M; r++) {
                const int8_t *xh = q + r * 2 * k + g * Q6_GROUP, *xl = xh + k;
                __m512i hs = _mm512_setzero_si512(), ls = _mm512_setzero_si512();
                for (int j = 4 * h; j < 4 * h + 4; j++) {
                    int32_t a, b;
                    memcpy(&a, xh + 4 * j, 4);
                    memcpy(&b, xl + 4 * j, 4);
                    hs = _mm512_dpbusd_epi32(hs, u[j], _mm512_set1_epi32(a));
                    ls = _mm512_dpbusd_epi32(ls, u[j], _mm512_set1_epi32(b));
                }
                __m512i s = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hs, 8), ls),
                                             _mm512_set1_epi32(32 * sxi[r * S + sub]));
                __m512 prod = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(dx[r * G + g]));
                acc[r] = _mm512_fmadd_ps(prod, w, acc[r]);
            }
        }
    }
    for (int r = 0; r < M; r++) _mm512_storeu_ps(out + r * Q6_ROWS, acc[r]);
}
#endif

typedef struct {
    const uint8_t *w;
    int64_t n, k, nb, m;
    int y_f32, generic;
    const int8_t *q;
    const float *dx;
    const int32_t *sxi;
    void *y;
} q6_job;

/* Blocks [b0, b1) for M activation rows at once. */
static inline __attribute__((always_inline)) void q6_blocks(const q6_job *j, int64_t b0,
                                                           int64_t b1, int64_t r0, const int M) {
    const int64_t k = j->k, block_bytes = k / Q6_RUN * Q6_RUN_BYTES;
    const int8_t *q = j->q + r0 * 2 * k;
    const float *dx = j->dx + r0 * (k / Q6_GROUP);
    const int32_t *sxi = j->sxi + r0 * (k / Q6_SUB);
    float out[Q6_MAX_M * Q6_ROWS];
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *blk = j->w + b * block_bytes;
#if Q6_VNNI
        if (!j->generic) q6_block_vnni(blk, k, q, dx, sxi, out, M);
        else
#endif
        q6_block_generic(blk, k, q, dx, sxi, out, M);
        const int64_t n = j->n, row = b * Q6_ROWS, rows = n - row < Q6_ROWS ? n - row : Q6_ROWS;
        for (int r = 0; r < M; r++) {
            const float *o = out + r * Q6_ROWS;
            if (j->y_f32) {
                memcpy((float *)j->y + (r0 + r) * n + row, o, (size_t)rows * sizeof(float));
            } else {
                uint16_t *yb = (uint16_t *)j->y + (r0 + r) * n + row;
                for (int64_t i = 0; i < rows; i++) yb[i] = f32_to_bf16(o[i]);
            }
        }
    }
}

/* Rows a tile of q6_share (q4_matvec.c's Q4_TILE_ROWS). */
#define Q6_TILE_ROWS 128

/* Blocks [b0, b1) for all activation rows, in tiles of Q6_TILE_ROWS rows, and within a tile
 * block after block, each for the tile's rows in passes of up to Q6_MAX_M (q4_matvec.c's
 * q4_share: a block read from RAM once a tile). Each output is one block's for one pass: the
 * same bits whatever the tiles. */
static void q6_share(const q6_job *j, int64_t b0, int64_t b1) {
    /* one pass (decode: up to Q6_MAX_M rows): the share's blocks in one loop */
    const int64_t per = j->m <= Q6_MAX_M ? b1 - b0 : 1;
    for (int64_t t0 = 0; t0 < j->m; t0 += Q6_TILE_ROWS) {
        const int64_t t1 = j->m - t0 < Q6_TILE_ROWS ? j->m : t0 + Q6_TILE_ROWS;
        for (int64_t b = b0; b < b1; b += per) {
            for (int64_t r0 = t0; r0 < t1; r0 += Q6_MAX_M) {
                switch (t1 - r0 < Q6_MAX_M ? t1 - r0 : Q6_MAX_M) {
                case 1: q6_blocks(j, b, b + per, r0, 1); break;
                case 2: q6_blocks(j, b, b + per, r0, 2); break;
                case 3: q6_blocks(j, b, b + per, r0, 3); break;
                default: q6_blocks(j, b, b + per, r0, 4); break;
                }
            }
        }
    }
}

/* part `part` of `parts` equal ranges of the row blocks, all activation rows (q6_share) */
static void q6_run_part(const void *job, int part, int parts) {
    const q6_job *j = job;
    q6_share(j, j->nb * part / parts, j->nb * (part + 1) / parts);
}

/* One activation row of k floats quantized for the product: q (2 k digits), dx and sx (k / 32
 * each, ss_q16_quantize_row's) and sxi (k / 16 integer sums of X, one a sub-block, exactly). */
static void q6_quantize_row(const float *row, int64_t k, int8_t *qr, float *dx, float *sx,
                            int32_t *sxi) {
    ss_q16_quantize_row(row, k, qr, qr + k, dx, sx);
    for (int64_t s = 0; s < k / Q6_SUB; s++) {
        int32_t t = 0;
        for (int i = 0; i < Q6_SUB; i++) t += 256 * qr[s * Q6_SUB + i] + qr[k + s * Q6_SUB + i];
        sxi[s] = t;
    }
}

/* q6_quantize_row for m float32 rows of k (q: m rows of 2 k, dx and sx: m rows of k / 32,
 * sxi: m rows of k / 16), for ss_q6_rows. */
void ss_q6_quantize_rows(const float *x, int64_t m, int64_t k, int8_t *q, float *dx, float *sx,
                         int32_t *sxi) {
    for (int64_t r = 0; r < m; r++)
        q6_quantize_row(x + r * k, k, q + r * 2 * k, dx + r * (k / Q6_GROUP),
                        sx + r * (k / Q6_GROUP), sxi + r * (k / Q6_SUB));
}

/* A packed weight (what Q6VnniLinear holds), passed as one pointer. */
typedef struct {
    const uint8_t *w;
    int64_t n, k;
} q6_weight;

#define Q6_X_F32 1   /* flags: x is float32 (else bfloat16); as q4_matvec.c's */
#define Q6_Y_F32 2   /* y is float32 (else bfloat16) */
#define Q6_GENERIC 4 /* the plain-C loop even where the VNNI loop is compiled in (tests) */
#define Q6_THREADS_SHIFT 8

/* y (m, n) = x (m, k) @ W^T for W (n, k) packed as above; x and y rows contiguous. */
void ss_q6_matvec(const q6_weight *wd, const void *x, void *y, int64_t m, int64_t flags) {
    const int64_t n = wd->n, k = wd->k, G = k / Q6_GROUP, S = k / Q6_SUB;
    const int64_t nb = (n + Q6_ROWS - 1) / Q6_ROWS;
    size_t fbytes = (size_t)k * sizeof(float);
    size_t qbytes = (size_t)(m * k * 2 + 63) / 64 * 64;
    size_t dbytes = 2 * (size_t)(m * G) * sizeof(float);
    char *scratch = malloc(fbytes + qbytes + dbytes + (size_t)(m * S) * sizeof(int32_t));
    if (scratch == NULL) return;  /* the caller's output stays as it was */
    float *xf = (float *)scratch;
    int8_t *q = (int8_t *)(scratch + fbytes);
    float *dx = (float *)(scratch + fbytes + qbytes), *sx = dx + m * G;
    int32_t *sxi = (int32_t *)(scratch + fbytes + qbytes + dbytes);
    int64_t threads = flags >> Q6_THREADS_SHIFT;
    if ((flags & Q6_X_F32) && m >= 64 && threads > 1) {
        /* a prefill's float32 rows quantized by the threads; entered only then (q4_matvec.c:
         * a construct with a false `if` slowed every decode matvec) */
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(dynamic, 16)
#endif
        for (int64_t r = 0; r < m; r++)
            q6_quantize_row((const float *)x + r * k, k, q + r * k * 2, dx + r * G, sx + r * G,
                            sxi + r * S);
    } else {
        for (int64_t r = 0; r < m; r++) {
            const float *row = row_as_f32(x, r, k, (flags & Q6_X_F32) != 0, xf);
            q6_quantize_row(row, k, q + r * k * 2, dx + r * G, sx + r * G, sxi + r * S);
        }
    }
    q6_job j = {wd->w, n, k, nb, m, (flags & Q6_Y_F32) != 0, (flags & Q6_GENERIC) != 0,
                q, dx, sxi, y};
    if (threads > nb / 4) threads = nb / 4;  /* at least 4 blocks a thread */
    ss_parallel(q6_run_part, &j, threads < 1 ? 1 : (int)threads, nb);
    free(scratch);
}

/* y (m, n) float32 = m rows quantized by ss_q6_quantize_rows times W^T, every block on the
 * calling thread (q6_share; q4_matvec.c's ss_q4_rows); ss_q6_matvec's bits. */
void ss_q6_rows(const q6_weight *wd, const int8_t *q, const float *dx, const int32_t *sxi,
                int64_t m, float *y) {
    const int64_t n = wd->n, k = wd->k, nb = (n + Q6_ROWS - 1) / Q6_ROWS;
    q6_job j = {wd->w, n, k, nb, m, 1, 0, q, dx, sxi, y};
    q6_share(&j, 0, nb);
}

/* Whether this build has the VNNI loop (else every call takes the plain-C one). */
int ss_q6_has_vnni(void) { return Q6_VNNI; }
