/* One OpenMP split of a kernel's work over `parts` threads, shared by q4_matvec.c and
 * plane_matvec.c. `run(job, part, parts)` computes part `part` of `parts` equal ranges.
 *
 * dynamic: the threads take SS_CHUNKS_PER_THREAD ranges each (at most max_chunks) from a shared
 * counter as they finish, rather than one equal range each. A region lasts as long as its
 * slowest thread, and on a host whose cores are shared (the GPU hosts' 16 vCPUs, with the main
 * thread enqueueing CUDA work, the driver's threads and the hypervisor beside the 15 workers),
 * one thread descheduled for a while holds every other one at the barrier. Each range is still
 * computed by one thread in one order, so the results are the equal split's bit for bit. */
#ifndef SLIPSTREAM_PARALLEL_H
#define SLIPSTREAM_PARALLEL_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define SS_CHUNKS_PER_THREAD 8

static inline void ss_parallel(void (*run)(const void *, int, int), const void *job, int parts,
                               int64_t max_chunks, int dynamic) {
#ifdef _OPENMP
    if (parts > 1) {
        if (dynamic) {
            int64_t chunks = (int64_t)parts * SS_CHUNKS_PER_THREAD;
            if (chunks > max_chunks) chunks = max_chunks;
#pragma omp parallel for num_threads(parts) schedule(dynamic, 1)
            for (int64_t c = 0; c < chunks; c++) run(job, (int)c, (int)chunks);
        } else {
#pragma omp parallel num_threads(parts)
            run(job, omp_get_thread_num(), omp_get_num_threads());
        }
        return;
    }
#endif
    (void)max_chunks;
    (void)dynamic;
    run(job, 0, 1);
}

#endif
