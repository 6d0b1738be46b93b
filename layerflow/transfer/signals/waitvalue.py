"""`waitvalue` signals: 32-bit words written after a layer's copies, waited with GEQ.

The words are written on a stream of the ring's own that waits for an event recorded after the layer's copies, not on
the copy stream: a stream write between two copies costs the copy engine time, an event does not (docs/performance.md).
The posting stream takes the writes in the order they were issued, like the copy stream.

Words never go back to 0 (a reset-to-zero protocol races across back-to-back replays, docs/design.md): each acquisition of
a counter takes that counter's next epoch, the posting stream writes it into the (counter, layer) word, and waiters
wait for `word - epoch >= 0` as int32 (the cyclic GEQ cuStreamWaitValue32 implements, so wrap-around is harmless).
The counter words live in pinned host memory (device-visible via UVA) so host waiters poll them directly.

Graph capture: a captured cuStreamWaitValue32 would freeze its target epoch. We chose "read the target from memory":
every onboarding also writes a global, monotonically increasing epoch into one device word per layer, and
`capture_gpu_wait(layer, stream)` captures a one-thread Triton kernel that spins until
`capture_word[layer] - target >= 0`, with `target` read from a device word. `prepare_replay(handle, stream)` writes
that target with a stream write on the launch stream just before the graph launch, so it is stream-ordered with
the replay it aims: no host write can retarget a replay already queued. Onboardings are issued in order on one H2D
stream and their posts in the same order on the posting stream, so a word >= this onboarding's epoch means this
onboarding's layer landed.

Posting goes through cuda.bindings or, with `LAYERFLOW_WAITVALUE_POST=native`, through ctypes (`native_post`).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from cuda.bindings import driver

from layerflow.transfer import cuda_api
from layerflow.config import SignalMode
from layerflow.transfer.cuda_api import check, poll_until, require_cuda
from layerflow.transfer.signals.base import LayerSignals, SignalHandle
from layerflow.transfer.signals.native_post import NativePoster, post_path

_MASK = 0xFFFFFFFF
_SPACING = 4  # int32s between device words: every word 16-byte aligned, so one Triton specialization serves all


@triton.jit
def _wait_geq_kernel(word_ptr, target_ptr):
    target = tl.load(target_ptr, volatile=True)
    current = tl.load(word_ptr, volatile=True)
    while current - target < 0:
        current = tl.load(word_ptr, volatile=True)


def _reached(value: int, epoch: int) -> bool:
    """Cyclic int32 GEQ, as cuStreamWaitValue32 evaluates it."""
    return ((value - epoch) & _MASK) < 2**31


def _write_op(address: int) -> driver.CUstreamBatchMemOpParams:
    """A 32-bit stream write to `address`, built once at set-up (building one costs microseconds of Python); the
    value is set per use."""
    op = driver.CUstreamBatchMemOpParams()
    op.writeValue.operation = driver.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32
    op.writeValue.address = address
    op.writeValue.flags = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    return op


def _write(stream: int, ops: list[driver.CUstreamBatchMemOpParams], values: list[int]) -> None:
    """`values` into the ops' words on `stream` as one stream operation. The call reads the ops before it returns, so
    they can be reused at once."""
    for op, value in zip(ops, values):
        op.writeValue.value = value & _MASK
    check(driver.cuStreamBatchMemOp(stream, len(ops), ops, 0), "cuStreamBatchMemOp")


class WaitValueSignals(LayerSignals):
    mode = SignalMode.WAITVALUE

    def __init__(self, num_layers: int, num_counters: int = 4, timeout_s: float = 10.0) -> None:
        require_cuda("signal mode 'waitvalue'")
        post = post_path()
        super().__init__(num_layers, num_counters, timeout_s)
        self._words = torch.zeros(num_counters * num_layers, dtype=torch.int32, pin_memory=True)
        self._host = self._words.numpy()
        self._capture = torch.zeros((num_layers + 1) * _SPACING, dtype=torch.int32, device="cuda")
        self._epochs = [0] * num_counters
        self._targets = [0] * num_counters
        self._global = 0
        # One (counter word, capture word) write pair per (counter, layer), and the replay target's write: the
        # writes are built here, not per onboarding (a counter is used by one onboarding at a time; replays are
        # prepared on the launching thread).
        self._post_ops = [[[_write_op(self._words.data_ptr() + 4 * self._index(counter, layer)),
                            _write_op(self._device_word(layer).data_ptr())] for layer in range(num_layers)]
                          for counter in range(num_counters)]
        self._target_op_address = self._device_word(num_layers).data_ptr()
        self._target_op = [_write_op(self._target_op_address)]
        self._post_stream: int | None = cuda_api.create_stream()
        self._copied = [[cuda_api.create_event() for _ in range(num_layers)] for _ in range(num_counters)]
        # The ctypes path (native_post) takes raw handles and addresses, all computed here.
        self._native = NativePoster(self._post_stream) if post == "native" else None
        self._post_targets = [[(int(self._copied[counter][layer]), self.word_address_of(counter, layer),
                                self._device_word(layer).data_ptr()) for layer in range(num_layers)]
                              for counter in range(num_counters)]
        _wait_geq_kernel[(1,)](self._device_word(0), self._device_word(num_layers), num_warps=1)
        torch.cuda.synchronize()

    def epoch(self, handle: SignalHandle) -> int:
        """The value `handle`'s layer words reach once landed (for native or custom waiters)."""
        return self._epochs[handle.counter_id]

    def word_address(self, handle: SignalHandle, layer: int) -> int:
        """Device-visible (UVA) address of `handle`'s word for `layer`."""
        return self.word_address_of(handle.counter_id, layer)

    def word_address_of(self, counter: int, layer: int) -> int:
        """The same for a counter by its index."""
        return self._words.data_ptr() + 4 * self._index(counter, layer)

    def capture_gpu_wait(self, layer: int, stream: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r}: expected an int in [0, {self.num_layers})")
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            _wait_geq_kernel[(1,)](self._device_word(layer), self._device_word(self.num_layers), num_warps=1)

    def prepare_replay(self, handle: SignalHandle | None, stream: int) -> None:
        target = self._global if handle is None else self._targets[handle.counter_id]
        if self._native is not None:
            self._native.write(stream, self._target_op_address, target)
        else:
            _write(stream, self._target_op, [target])

    def close(self) -> None:
        if self._post_stream is None:
            return
        check(driver.cuStreamSynchronize(self._post_stream), "cuStreamSynchronize")
        cuda_api.destroy_stream(self._post_stream)
        for event in [e for row in self._copied for e in row]:
            cuda_api.destroy_event(event)
        self._post_stream, self._copied = None, []

    def _device_word(self, index: int) -> torch.Tensor:
        """Capture word of layer `index`, or (index == num_layers) the replay target."""
        return self._capture[index * _SPACING:index * _SPACING + 1]

    def _index(self, counter: int, layer: int) -> int:
        return counter * self.num_layers + layer

    def _reset_counter(self, counter: int) -> None:
        self._epochs[counter] = (self._epochs[counter] + 1) & _MASK
        self._global = (self._global + 1) & _MASK
        self._targets[counter] = self._global

    def _signal(self, handle: SignalHandle, layers: list[int], stream: int | None) -> None:
        counter = handle.counter_id
        epoch, target = self._epochs[counter], self._targets[counter]
        for layer in layers:
            if stream is None:
                # Done on the host: the counter word at once (host waiters poll it), and the capture word that
                # captured graphs spin on through the posting stream, behind this counter's earlier posts (without
                # it a replay waiting on a layer posted from the host, e.g. an onboarding read back from SSD
                # alone, spins forever).
                self._host[self._index(counter, layer)] = epoch - 2**32 if epoch >= 2**31 else epoch
                if self._native is not None:
                    self._native.write(self._post_stream, self._device_word(layer).data_ptr(), target)
                else:
                    _write(self._post_stream, self._post_ops[counter][layer][1:], [target])
            elif self._native is not None:
                event, word, capture = self._post_targets[counter][layer]
                self._native.post(event, stream, ((word, epoch), (capture, target)))
            else:
                copied = self._copied[counter][layer]
                cuda_api.record(copied, stream)
                cuda_api.stream_wait(self._post_stream, copied)
                _write(self._post_stream, self._post_ops[counter][layer], [epoch, target])

    def _poison(self, handle: SignalHandle, layers: list[int], stream: int | None) -> None:
        self._signal(handle, layers, stream)

    def _host_wait(self, handle: SignalHandle, layer: int, deadline: float) -> bool:
        counter = handle.counter_id
        index, epoch = self._index(counter, layer), self._epochs[counter]
        return poll_until(lambda: self.status[counter] != 0 or _reached(int(self._host[index]), epoch), deadline)

    def _gpu_wait(self, handle: SignalHandle, layer: int, stream: int) -> None:
        check(driver.cuStreamWaitValue32(stream, self.word_address(handle, layer), self.epoch(handle),
                                         driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
              "cuStreamWaitValue32")
