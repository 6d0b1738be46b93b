/* Spin until a 32-bit host word that the GPU writes becomes non-zero, reading it at most `spins` times.
 *
 * The fetch's wait for a batch's done word (runtime/done_word.py): called through ctypes, which drops the GIL for
 * the call, so other Python threads run while the host waits for the device. Returns 1 once the word is set, 0 when
 * the spins ran out (the caller then checks that the stream is still busy and calls again). */
#include <stdint.h>

int32_t layerflow_spin_word(const volatile int32_t *word, int64_t spins) {
    for (int64_t i = 0; i < spins; i++) {
        if (*word != 0) {
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            return 1;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
    }
    return 0;
}
