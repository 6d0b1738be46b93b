/* Issue layers [first, last) of a one-run transfer in one call: per layer, its run as one cudaMemcpy2DAsync on the
 * copy stream (`rows` rows of `width` bytes from `src_bases[l] + src_offset`, `src_pitch` apart, to `dst_bases[l] +
 * dst_offset`, `dst_pitch` apart, in direction `kind`), then (an onboarding, where `events` is given) the waitvalue
 * post of that layer: an event recorded on the copy stream, the posting stream's wait for it and one
 * cuStreamBatchMemOp writing the layer's counter word and capture word.
 *
 * Why in C: through Python each layer's copy and post cost the caller's thread ~15-40 us on the H200's host (ctypes
 * and cuda.bindings conversions, the ring's bookkeeping); here the driver's own cost is all that is left. The CUDA
 * entry points are handed in as function pointers (the process's libcudart and libcuda, as ctypes found them), so
 * this file needs no CUDA header and builds with the system C compiler; the CPU tests hand in recording stand-ins.
 *
 * Returns the number of layers fully issued (copy and post). On a failed call it stops there: `*error` is the call's
 * status and `*stage` which call (1 copy, 2 event record, 3 stream wait, 4 stream writes). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*lf_memcpy2d_fn)(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              int kind, void *stream);
typedef int (*lf_event_record_fn)(void *event, void *stream);
typedef int (*lf_stream_wait_fn)(void *stream, void *event, unsigned int flags);
typedef int (*lf_batch_mem_op_fn)(void *stream, unsigned int count, void *ops, unsigned int flags);

/* CUstreamBatchMemOpParams (a 48-byte union) as a 32-bit write: operation, address, value, flags, alias. */
typedef struct {
    uint32_t operation;
    uint32_t pad0;
    uint64_t address;
    uint64_t value;
    uint32_t flags;
    uint32_t pad1;
    uint64_t alias;
    uint64_t pad2;
} lf_write_op;

#define LF_WRITE_VALUE_32 2u

typedef struct {
    lf_memcpy2d_fn memcpy2d;
    lf_event_record_fn event_record;
    lf_stream_wait_fn stream_wait;
    lf_batch_mem_op_fn batch_mem_op;
} lf_cuda_calls;

static void lf_write(lf_write_op *op, uint64_t address, uint32_t value) {
    memset(op, 0, sizeof *op);
    op->operation = LF_WRITE_VALUE_32;
    op->address = address;
    op->value = value;
}

int64_t layerflow_issue_run(const lf_cuda_calls *calls, int64_t first, int64_t last,
                            const uint64_t *dst_bases, uint64_t dst_offset, uint64_t dst_pitch,
                            const uint64_t *src_bases, uint64_t src_offset, uint64_t src_pitch, uint64_t width,
                            uint64_t rows, int32_t kind, void *stream,
                            const uint64_t *events, const uint64_t *words, uint32_t epoch,
                            const uint64_t *captures, uint32_t target, void *post_stream,
                            int32_t *error, int32_t *stage) {
    lf_write_op ops[2];
    *error = 0;
    *stage = 0;
    for (int64_t layer = first; layer < last; layer++) {
        int status = calls->memcpy2d((void *)(uintptr_t)(dst_bases[layer] + dst_offset), dst_pitch,
                                     (const void *)(uintptr_t)(src_bases[layer] + src_offset), src_pitch, width, rows,
                                     kind, stream);
        if (status != 0) {
            *error = status;
            *stage = 1;
            return layer - first;
        }
        if (events == NULL)
            continue;
        void *event = (void *)(uintptr_t)events[layer];
        if ((status = calls->event_record(event, stream)) != 0) {
            *error = status;
            *stage = 2;
            return layer - first;
        }
        if ((status = calls->stream_wait(post_stream, event, 0)) != 0) {
            *error = status;
            *stage = 3;
            return layer - first;
        }
        lf_write(&ops[0], words[layer], epoch);
        lf_write(&ops[1], captures[layer], target);
        if ((status = calls->batch_mem_op(post_stream, 2, ops, 0)) != 0) {
            *error = status;
            *stage = 4;
            return layer - first;
        }
    }
    return last - first;
}
