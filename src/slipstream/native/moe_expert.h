/* A mixture of experts' expert as moe_ffn.c (a decode token) and moe_rows.c (a prefill's rows)
 * read it, the descriptor weights/cpu/expert_decode.py builds. */
#ifndef SS_MOE_EXPERT_H
#define SS_MOE_EXPERT_H

#include <stdint.h>

/* q4_matvec.c's, q6_matvec.c's, cb4_matvec.c's and iq_matvec.c's weights all start with these
 * fields */
typedef struct {
    const uint8_t *w;
    int64_t n, k;
} moe_weight_head;

/* One expert: its gate/up (gate rows, then up rows) and its down, each a q4_matvec.c
 * q4_weight unless `layouts` says otherwise (MOE_* bits below), and their float32 biases
 * (gate's then up's, 2 units; hidden) or NULL. */
typedef struct {
    const void *gate_up;
    const void *down;
    int64_t layouts;
    const float *gate_up_bias;
    const float *down_bias;
} moe_expert;

#define MOE_DOWN_Q6 1      /* down is a q6_matvec.c q6_weight */
#define MOE_GATE_UP_CB4 2  /* gate/up is a cb4_matvec.c cb4_weight */
#define MOE_DOWN_CB4 4     /* down is a cb4_weight */
#define MOE_GATE_UP_IQ 8   /* gate/up is an iq_matvec.c iq_weight */
#define MOE_DOWN_IQ 16     /* down is an iq_weight */

#endif
