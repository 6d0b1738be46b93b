/*
 * Spin until a CUDA event has completed, in native code, so the interpreter's lock is free the whole time.
 *
 * The host learns that a batch's scores are on the host by this poll instead of a blocking stream
 * synchronisation. The event query is the runtime's own cudaEventQuery, passed in as a function pointer, so
 * this file links against nothing but libc. It returns the query's last status: 0 once the event completed,
 * another CUDA error code if the query failed, or cudaErrorNotReady (600) when timeout_ns passed first.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <time.h>

enum { LAYERFLOW_NOT_READY = 600 };   /* cudaErrorNotReady */

typedef int (*layerflow_event_query)(void *event);

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int layerflow_spin_event(layerflow_event_query query, void *event, int64_t timeout_ns)
{
    int64_t deadline_ns = now_ns() + timeout_ns;
    int status;
    while ((status = query(event)) == LAYERFLOW_NOT_READY) {
        if (now_ns() >= deadline_ns)
            break;
    }
    return status;
}
