/* One OpenMP split of a kernel's work over `parts` threads (q4_matvec.c). `run(job, part,
 * parts)` computes part `part` of `parts` equal ranges.
 *
 * The threads take SS_CHUNKS_PER_THREAD ranges each (at most max_chunks) from a shared counter
 * as they finish, rather than one equal range each. A region lasts as long as its slowest
 * thread, and on a host whose cores are shared (the GPU hosts' 16 vCPUs, with the main thread
 * enqueueing CUDA work, the driver's threads and the hypervisor beside the 15 workers), one
 * thread descheduled for a while holds every other one at the barrier: on a 16-core H100 host
 * a 70B's split layers' CPU shares ran at 104.4 GB/s with chunks against 82.9 with one equal
 * range a thread (15 threads), and hybrid decode at 5.25 against 4.14 tok/s. Each range is
 * still computed by one thread in one order, so the results are an equal split's bit for bit. */
#ifndef SS_PARALLEL_H
#define SS_PARALLEL_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define SS_CHUNKS_PER_THREAD 8

static inline void ss_parallel(void (*run)(const void *, int, int), const void *job, int parts,
                               int64_t max_chunks) {
#ifdef _OPENMP
    if (parts > 1) {
        int64_t chunks = (int64_t)parts * SS_CHUNKS_PER_THREAD;
        if (chunks > max_chunks) chunks = max_chunks;
#pragma omp parallel for num_threads(parts) schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) run(job, (int)c, (int)chunks);
        return;
    }
#endif
    (void)max_chunks;
    run(job, 0, 1);
}

#endif
