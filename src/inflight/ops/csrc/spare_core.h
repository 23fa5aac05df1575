/* spare_core.c: one helper thread that takes blocks of a loop while it is on
 * a core, for loops run where the kernels have given up their other threads. */
#ifndef INFLIGHT_SPARE_CORE_H
#define INFLIGHT_SPARE_CORE_H

#include <stdint.h>

/* Block `block` of a loop; `worker` is 0 on the calling thread, 1 on the
 * helper (for per-thread scratch memory). */
typedef void (*spare_task)(void *ctx, int64_t block, int worker);

/* Whether loops may take the helper now (inflight_spare_core). */
int spare_core_on(void);
/* Runs task(ctx, b, worker) for every b in [0, blocks) and returns when all
 * are done: the calling thread takes blocks one after another, and the helper,
 * woken, takes them too while the kernel gives it a core. The caller never
 * waits for the helper to start, only for a block it took to end (spare_core.c
 * says the one exception). Without the
 * helper (off, not started, or busy with another thread's loop) the caller
 * runs every block. Each block runs exactly once, on one thread. */
void spare_core_run(int64_t blocks, spare_task task, void *ctx);

/* Exported (ctypes): lend the helper to loops or not (started the first time
 * it is lent); the blocks it has run since the process started. */
void inflight_spare_core(int64_t on);
int64_t inflight_spare_core_blocks(void);

#endif
