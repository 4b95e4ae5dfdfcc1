/* One decode token's routed experts in one call: the CPU's mixture-of-experts FFN
 * (weights/cpu/expert_decode.py),
 *     sum_j w_j (down_j(act(gate_j x + bg_j) * (up_j x + bu_j)) + bd_j),
 * act SiLU (SwiGLU), GELU's tanh form (GeGLU: Gemma 4) or gpt-oss's clamped SwiGLU, the biases
 * gpt-oss's (absent elsewhere).
 *
 * Why: through torch, each of a token's k experts is a dozen small ops and two kernel calls,
 * each kernel an OpenMP region of its own: a Qwen3-MoE layer (k = 8) was 16 fork-joins and ~100
 * dispatches a token. On a shared 2-core machine a region waits for its slowest thread, and a
 * thread descheduled by another process holds it for a time slice. Here the k experts are the
 * tasks of one region, taken by the threads as they come free (dynamic), each expert computed
 * whole by one thread: gate/up (q4vnni or q8vnni records, native/q4_matvec.c, or cb4,
 * native/cb4_matvec.c), its bias and the gated product in float32 (decode_ops.c's ss_glu_f32),
 * down (q4vnni, q8vnni, q6vnni (native/q6_matvec.c)
 * or cb4) and its bias, into its own buffer; then the
 * calling thread adds them up in the order given (the caller's: ascending expert ids), each
 * term w_j y_j rounded once and added once, as `out += y * w` in torch. So a token's bits do not
 * depend on the thread count or on which thread took which expert.
 */

#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "moe_expert.h"

void ss_q4_matvec(const void *wd, const void *x, void *y, int64_t m, int64_t flags);
void ss_q6_matvec(const void *wd, const void *x, void *y, int64_t m, int64_t flags);
void ss_cb4_matvec(const void *wd, const void *x, void *y, int64_t m, int64_t flags);
void ss_iq_matvec(const void *wd, const void *x, void *y, int64_t m, int64_t flags);
void ss_glu_f32(float *gate_up, const float *bias, int64_t m, int64_t n, int64_t act,
                float *out);

#define MOE_F32 3              /* x and y float32 (the matvecs' flags) */
#define MOE_ONE_THREAD (1 << 8)  /* each matvec on the thread that runs its expert */

/* out (hidden) = sum_j w[j] * expert_j(x) for x (hidden) float32, the experts in the order
 * given, `act` ss_glu_f32's (0 SiLU, 1 GELU tanh, 2 gpt-oss's); `threads` share the experts.
 * Returns 0, or -1 where scratch could not be allocated (out untouched). */
int ss_moe_ffn(const moe_expert *const *experts, int64_t k, const float *x, const float *w,
               float *out, int64_t threads, int64_t act) {
    int64_t hidden = ((const moe_weight_head *)experts[0]->down)->n, units = 0;
    for (int64_t j = 0; j < k; j++) {
        int64_t u = ((const moe_weight_head *)experts[j]->down)->k;
        units = u > units ? u : units;
    }
    /* per expert: gate/up (2 units), the gated product (units), its output (hidden) */
    const int64_t per = 3 * units + hidden;
    float *scratch = malloc((size_t)(k * per) * sizeof(float));
    if (scratch == NULL) return -1;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads > 1 ? (int)threads : 1) schedule(dynamic, 1) \
        if (threads > 1)
#endif
    for (int64_t j = 0; j < k; j++) {
        const moe_expert *e = experts[j];
        const int64_t n = ((const moe_weight_head *)e->down)->k;
        float *gu = scratch + j * per, *prod = gu + 2 * units, *y = prod + units;
        const int64_t f = MOE_F32 | MOE_ONE_THREAD;
        if (e->layouts & MOE_GATE_UP_CB4) ss_cb4_matvec(e->gate_up, x, gu, 1, f);
        else if (e->layouts & MOE_GATE_UP_IQ) ss_iq_matvec(e->gate_up, x, gu, 1, f);
        else ss_q4_matvec(e->gate_up, x, gu, 1, f);
        ss_glu_f32(gu, e->gate_up_bias, 1, n, act, prod);
        if (e->layouts & MOE_DOWN_Q6) ss_q6_matvec(e->down, prod, y, 1, f);
        else if (e->layouts & MOE_DOWN_CB4) ss_cb4_matvec(e->down, prod, y, 1, f);
        else if (e->layouts & MOE_DOWN_IQ) ss_iq_matvec(e->down, prod, y, 1, f);
        else ss_q4_matvec(e->down, prod, y, 1, f);
        /* bias + y, as torch.add(bias, y) (weights/cpu/groups.py finish) */
        if (e->down_bias != NULL)
            for (int64_t i = 0; i < hidden; i++) y[i] = e->down_bias[i] + y[i];
    }
    for (int64_t i = 0; i < hidden; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float *y = scratch + j * per + 3 * units, wj = w[j];
        for (int64_t i = 0; i < hidden; i++) {
            float t = y[i] * wj;
            out[i] = out[i] + t;
        }
    }
    free(scratch);
    return 0;
}
