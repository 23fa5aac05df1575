/* One helper thread for the loops the kernels run on a single thread because
 * the engine process gave its other threads up to the processes beside it
 * (worker.cpu_share: a tiny model's API server and its clients on two cores).
 *
 * An OpenMP region waits at its end for every thread it woke, so when the
 * core a worker needs is taken, the caller waits for a thread the kernel has
 * not run yet (behind the server on two cores a region's threads began a
 * third of a millisecond late, docs/benchmarks.md). Here the caller and the
 * helper claim blocks from one counter: a helper that gets no core in time
 * takes nothing, the caller does not wait for it, and the loop costs one
 * wake-up (a futex system call) more than on one thread and gains whatever
 * the helper ran. The caller waits only for a block the helper took: it
 * spins a little, then sleeps, leaving its core to the helper.
 *
 * The claim word holds the loop's generation, its number of blocks and the
 * next block; a claim is a compare-and-swap that fails once the loop is over
 * or another began, so a helper that wakes late takes nothing of a loop that
 * ended. It reads a loop's task only after claiming one of its blocks; the
 * caller returns (and may write the next loop's task) only once every block
 * is claimed and the helper is out (`working`). The helper checks in before
 * it claims, so a helper preempted in those few instructions is waited for
 * even though it took nothing. Linux only (futex); elsewhere the helper never
 * starts and every loop runs on its caller.
 */
#include "spare_core.h"

#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define COUNT_BITS 20
#define COUNT_MASK ((UINT64_C(1) << COUNT_BITS) - 1)
#define GEN_SHIFT (2 * COUNT_BITS)
#define GEN_MASK ((UINT64_C(1) << 24) - 1)
/* Pauses the caller spins waiting for the helper's last block before it sleeps. */
#define WAIT_SPINS 2000

static _Atomic uint64_t claim;    /* generation << GEN_SHIFT | blocks << COUNT_BITS | next */
static _Atomic int bell;          /* rung once a loop: the helper's futex word */
static _Atomic int helper_asleep;
static _Atomic int working;       /* the helper, between its check-in and check-out */
static _Atomic int caller_asleep;
static _Atomic int lent;
static _Atomic int64_t helper_blocks;
static int started;               /* under start_lock */
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t loop_lock = PTHREAD_MUTEX_INITIALIZER;
static spare_task loop_task;      /* the loop's, written under loop_lock */
static void *loop_ctx;
static uint64_t loop_gen;

static void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#ifdef __linux__
static void futex_wait(_Atomic int *word, int value)
{
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake(_Atomic int *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}
#endif

/* Whether claim word c's loop has a block left to claim. */
static int blocks_left(uint64_t c)
{
    return (c & COUNT_MASK) < ((c >> COUNT_BITS) & COUNT_MASK);
}

/* The next block of loop `gen`, or -1 once none is left (or another loop began). */
static int64_t take(uint64_t gen)
{
    uint64_t c = atomic_load(&claim);
    while ((c >> GEN_SHIFT) == gen && blocks_left(c)) {
        if (atomic_compare_exchange_weak(&claim, &c, c + 1))
            return (int64_t)(c & COUNT_MASK);
    }
    return -1;
}

#ifdef __linux__
static void *helper_main(void *unused)
{
    (void)unused;
    omp_set_num_threads(1); /* the kernels' own parallel loops run on it alone */
    int seen = atomic_load(&bell);
    for (;;) {
        const int rung = atomic_load(&bell);
        if (rung == seen) {
            atomic_store(&helper_asleep, 1);
            if (atomic_load(&bell) == seen)
                futex_wait(&bell, seen);
            atomic_store(&helper_asleep, 0);
            continue;
        }
        seen = rung;
        /* (A late wake-up finds the loop taken: no check-in, nothing to wait for.) */
        if (!blocks_left(atomic_load(&claim)))
            continue;
        atomic_fetch_add(&working, 1);
        const uint64_t gen = atomic_load(&claim) >> GEN_SHIFT;
        int64_t block;
        while ((block = take(gen)) >= 0) {
            loop_task(loop_ctx, block, 1);
            atomic_fetch_add(&helper_blocks, 1);
        }
        if (atomic_fetch_sub(&working, 1) == 1 && atomic_load(&caller_asleep))
            futex_wake(&working);
    }
    return NULL;
}

/* fork() waits for a loop to end; in the child the helper thread is gone:
 * lend none until asked again. */
static void before_fork(void)
{
    pthread_mutex_lock(&start_lock);
    pthread_mutex_lock(&loop_lock);
}

static void after_fork_in_parent(void)
{
    pthread_mutex_unlock(&loop_lock);
    pthread_mutex_unlock(&start_lock);
}

static void after_fork_in_child(void)
{
    started = 0;
    atomic_store(&lent, 0);
    atomic_store(&working, 0);
    atomic_store(&helper_asleep, 0);
    atomic_store(&caller_asleep, 0);
    pthread_mutex_unlock(&loop_lock);
    pthread_mutex_unlock(&start_lock);
}
#endif

void inflight_spare_core(int64_t on)
{
#ifdef __linux__
    pthread_mutex_lock(&start_lock);
    if (on && !started) {
        static int registered;
        if (!registered)
            registered = pthread_atfork(before_fork, after_fork_in_parent,
                                        after_fork_in_child) == 0;
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        started = registered && pthread_create(&thread, &attr, helper_main, NULL) == 0;
        pthread_attr_destroy(&attr);
    }
    atomic_store(&lent, on && started);
    pthread_mutex_unlock(&start_lock);
#else
    (void)on;
#endif
}

int64_t inflight_spare_core_blocks(void)
{
    return atomic_load(&helper_blocks);
}

int spare_core_on(void)
{
    return atomic_load(&lent);
}

static void wait_for_helper(void)
{
    for (int spins = 0; atomic_load(&working) != 0; spins++) {
        if (spins < WAIT_SPINS) {
            relax();
            continue;
        }
#ifdef __linux__
        atomic_store(&caller_asleep, 1);
        const int w = atomic_load(&working);
        if (w != 0)
            futex_wait(&working, w);
        atomic_store(&caller_asleep, 0);
#endif
    }
}

void spare_core_run(int64_t blocks, spare_task task, void *ctx)
{
    if (blocks <= 0)
        return;
    if (blocks == 1 || (uint64_t)blocks > COUNT_MASK || !spare_core_on()
        || pthread_mutex_trylock(&loop_lock) != 0) {
        for (int64_t b = 0; b < blocks; b++)
            task(ctx, b, 0);
        return;
    }
    loop_task = task;
    loop_ctx = ctx;
    loop_gen = (loop_gen + 1) & GEN_MASK;
    const uint64_t gen = loop_gen;
    atomic_store(&claim, gen << GEN_SHIFT | (uint64_t)blocks << COUNT_BITS);
    atomic_fetch_add(&bell, 1);
#ifdef __linux__
    if (atomic_load(&helper_asleep))
        futex_wake(&bell);
#endif
    int64_t block;
    while ((block = take(gen)) >= 0)
        task(ctx, block, 0);
    wait_for_helper();
    pthread_mutex_unlock(&loop_lock);
}
