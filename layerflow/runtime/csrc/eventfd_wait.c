/*
 * Native wait on a layer's eventfd, run by CUDA as a host function inside a captured graph.
 *
 * CUDA runs every host function on one callback thread; a host function written in Python would take
 * the GIL there and stall a layer for the interpreter's switch interval whenever the main thread runs
 * Python. This file never calls into Python: it polls, reads and stamps a clock, nothing else.
 *
 * The slot lives at a fixed host address for the life of the captured graph; the runtime rewrites
 * fd, timeout_ms and poison before each replay and reads status and released_ns afterwards.
 * Each fd must have exactly one reader (this function): then POLLIN guarantees read() does not block.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

enum {
    LAYERFLOW_WAIT_OK = 0,
    LAYERFLOW_WAIT_TIMEOUT = 1,
    LAYERFLOW_WAIT_POISONED = 2,
    LAYERFLOW_WAIT_READ_ERROR = 3,
};

/* How often a wait with a poison word looks at it: a failed transfer is noticed within this. */
#define LAYERFLOW_POISON_SLICE_MS 1

typedef struct {
    int32_t fd;                /* eventfd to consume one count from; < 0 means "no wait" */
    int32_t timeout_ms;        /* give up after this long: a wait never blocks forever */
    int32_t status;            /* written last, with release ordering */
    int32_t pad;
    int64_t released_ns;       /* CLOCK_MONOTONIC at release (same clock as time.monotonic_ns) */
    volatile int32_t *poison;  /* optional: nonzero means the transfer failed; a timeout sets it */
} layerflow_wait_slot;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int is_poisoned(const layerflow_wait_slot *slot)
{
    return slot->poison != NULL && *slot->poison != 0;
}

static void finish(layerflow_wait_slot *slot, int32_t status)
{
    slot->released_ns = now_ns();
    __atomic_store_n(&slot->status, status, __ATOMIC_RELEASE);
}

/* Poll timeout for the next round: the time left rounded up (never return before the deadline),
 * clipped to the poison slice when there is a poison word to watch. */
static int next_poll_ms(const layerflow_wait_slot *slot, int64_t deadline_ns)
{
    int64_t left_ns = deadline_ns - now_ns();
    if (left_ns <= 0)
        return 0;
    int64_t ms = (left_ns + 999999) / 1000000;
    if (slot->poison != NULL && ms > LAYERFLOW_POISON_SLICE_MS)
        ms = LAYERFLOW_POISON_SLICE_MS;
    return (int)ms;
}

void layerflow_eventfd_wait(void *arg)
{
    layerflow_wait_slot *slot = (layerflow_wait_slot *)arg;
    if (slot->fd < 0) {
        finish(slot, LAYERFLOW_WAIT_OK);
        return;
    }
    int64_t timeout_ms = slot->timeout_ms > 0 ? slot->timeout_ms : 0;
    int64_t deadline_ns = now_ns() + timeout_ms * 1000000LL;
    for (;;) {
        if (is_poisoned(slot)) {
            finish(slot, LAYERFLOW_WAIT_POISONED);
            return;
        }
        int poll_ms = next_poll_ms(slot, deadline_ns);
        struct pollfd pfd = {.fd = slot->fd, .events = POLLIN, .revents = 0};
        int ready = poll(&pfd, 1, poll_ms);
        if (ready < 0) {
            if (errno == EINTR)
                continue;
            finish(slot, LAYERFLOW_WAIT_READ_ERROR);
            return;
        }
        if (ready == 0) {
            if (poll_ms == 0) {
                /* Poison the counter: the later layers of this onboarding then end at once instead of each
                 * waiting its own timeout (a hung producer costs one timeout per batch, not one per layer). */
                if (slot->poison != NULL)
                    __atomic_store_n(slot->poison, 1, __ATOMIC_RELEASE);
                finish(slot, LAYERFLOW_WAIT_TIMEOUT);
                return;
            }
            continue;
        }
        if (!(pfd.revents & POLLIN)) {
            finish(slot, LAYERFLOW_WAIT_READ_ERROR);
            return;
        }
        uint64_t count;
        ssize_t got = read(slot->fd, &count, sizeof count);
        if (got == (ssize_t)sizeof count) {
            finish(slot, LAYERFLOW_WAIT_OK);
            return;
        }
        if (got < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        finish(slot, LAYERFLOW_WAIT_READ_ERROR);
        return;
    }
}

/*
 * A native notifier: for each i, sleep until at_ns[i] (CLOCK_MONOTONIC), stamp written_ns[i] and add one
 * to fds[i]. Called through ctypes (the GIL is released for the whole schedule), so the post times do
 * not depend on what the interpreter is doing. Returns the number of writes that failed.
 */
int32_t layerflow_eventfd_post_at(const int32_t *fds, const int64_t *at_ns, int64_t *written_ns, int32_t n)
{
    int32_t failed = 0;
    for (int32_t i = 0; i < n; i++) {
        struct timespec at = {.tv_sec = at_ns[i] / 1000000000LL, .tv_nsec = at_ns[i] % 1000000000LL};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, NULL) == EINTR)
            ;
        uint64_t one = 1;
        written_ns[i] = now_ns();
        if (write(fds[i], &one, sizeof one) != (ssize_t)sizeof one)
            failed++;
    }
    return failed;
}
