"""A one-run onboarding's layers issued in C (transfer/native_issue.py, csrc/issue_run.c), on the CPU with stand-in
CUDA calls that do what the real ones do to host memory: each layer's run lands byte-exact (a 2D copy, pitch to
packed), each layer's event is recorded on the copy stream and waited by the posting stream before one batch of two
word writes (its counter word takes the epoch, its capture word the target), layers in order across a lead and the
rest; a failing call stops the loop at its layer, poisons the signal from there and finishes once with the error;
the ring marks exactly the issued layers posted. On the H200 the CUDA engine's native path matches the Python path
byte for byte and signal for signal."""

import ctypes
import struct

import numpy as np
import pytest

from layerflow.config import SignalMode
from layerflow.transfer.errors import TransferError
from layerflow.transfer.native_issue import CudaCalls, RunIssue, RunLayers, issue_run_fn, native_issue_configured
from layerflow.transfer.signals.base import LayerSignals, NativePosts

LAYERS, PAGE, BLOCKS, ROWS = 4, 64, 6, 3

_ptr = ctypes.c_void_p
MEMCPY_2D = ctypes.CFUNCTYPE(ctypes.c_int, _ptr, ctypes.c_size_t, _ptr, ctypes.c_size_t, ctypes.c_size_t,
                             ctypes.c_size_t, ctypes.c_int, _ptr)
EVENT_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, _ptr, _ptr)
STREAM_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, _ptr, _ptr, ctypes.c_uint)
BATCH_MEM_OP = ctypes.CFUNCTYPE(ctypes.c_int, _ptr, ctypes.c_uint, _ptr, ctypes.c_uint)
WRITE_VALUE_32 = 2


class StandIns:
    """Recording CUDA calls acting on host memory; `fail_at` = (call name, nth call of it) returns error 7."""

    def __init__(self, fail_at=None):
        self.log, self.fail_at, self.counts = [], fail_at, {}
        self._fns = [MEMCPY_2D(self._memcpy2d), EVENT_RECORD(self._record), STREAM_WAIT(self._wait),
                     BATCH_MEM_OP(self._batch)]
        self.calls = CudaCalls(*(ctypes.cast(f, ctypes.c_void_p).value for f in self._fns))

    def _fails(self, name):
        self.counts[name] = self.counts.get(name, 0) + 1
        return self.fail_at == (name, self.counts[name])

    def _memcpy2d(self, dst, dpitch, src, spitch, width, height, kind, stream):
        if self._fails("copy"):
            return 7
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
        self.log.append(("copy", dst, kind, stream))
        return 0

    def _record(self, event, stream):
        if self._fails("record"):
            return 7
        self.log.append(("record", event, stream))
        return 0

    def _wait(self, stream, event, flags):
        if self._fails("wait"):
            return 7
        self.log.append(("wait", stream, event))
        return 0

    def _batch(self, stream, count, ops, flags):
        if self._fails("batch"):
            return 7
        raw = ctypes.string_at(ops, 48 * count)
        writes = []
        for i in range(count):
            operation, address, value = struct.unpack_from("<IxxxxQQ", raw, 48 * i)
            assert operation == WRITE_VALUE_32
            ctypes.c_uint32.from_address(address).value = value & 0xFFFFFFFF
            writes.append((address, value))
        self.log.append(("batch", stream, tuple(writes)))
        return 0


class NativeRing(LayerSignals):
    """A ring whose native posts are host tables: event ids 100 + layer, per-layer counter and capture words."""

    mode = SignalMode.WAITVALUE
    has_native_posts = True

    def __init__(self):
        super().__init__(LAYERS, num_counters=2, timeout_s=1.0)
        self.events = np.arange(100, 100 + LAYERS, dtype=np.uint64)
        self.words = np.zeros(LAYERS, dtype=np.uint32)
        self.captures = np.zeros(LAYERS, dtype=np.uint32)
        self.word_addresses = np.array([self.words.ctypes.data + 4 * i for i in range(LAYERS)], dtype=np.uint64)
        self.capture_addresses = np.array([self.captures.ctypes.data + 4 * i for i in range(LAYERS)],
                                          dtype=np.uint64)
        self.python_posts = []

    def native_posts(self, handle):
        return NativePosts(self.events.ctypes.data, self.word_addresses.ctypes.data, 41,
                           self.capture_addresses.ctypes.data, 77, 55)

    def _signal(self, handle, layers, stream):
        self.python_posts.append(tuple(layers))

    def _poison(self, handle, layers, stream):
        self.python_posts.append(("poison", tuple(layers)))

    def _host_wait(self, handle, layer, deadline):
        return True


def _pages():
    """A host block tensor's bytes ([BLOCKS, LAYERS, page]), GPU layers' bytes ([LAYERS, BLOCKS, page]) and the run
    of host blocks 2..4 onto GPU pages 1..3."""
    host = np.random.default_rng(0).integers(0, 255, size=(BLOCKS, LAYERS, PAGE), dtype=np.uint8)
    gpu = np.zeros((LAYERS, BLOCKS, PAGE), dtype=np.uint8)
    pitch = LAYERS * PAGE
    run = RunLayers(np.array([gpu.ctypes.data + l * BLOCKS * PAGE for l in range(LAYERS)], dtype=np.uint64),
                    1 * PAGE, PAGE, np.array([host.ctypes.data + l * PAGE for l in range(LAYERS)], dtype=np.uint64),
                    2 * pitch, pitch, PAGE, ROWS, 1)
    return host, gpu, run


needs_library = pytest.mark.skipif(issue_run_fn() is None, reason="no C compiler: the Python path is used")


@needs_library
def test_lead_then_rest_copies_each_run_and_posts_each_layer_in_order():
    host, gpu, run = _pages()
    ring, calls, ends = NativeRing(), StandIns(), []
    handle = ring.acquire()
    issue = RunIssue(issue_run_fn(), calls.calls, run, LAYERS, handle, 0, 9, ends.append)
    issue.issue(1)
    assert issue.next_layer == 1 and not issue.done and ends == []
    assert ring._posted[handle.counter_id] == [True, False, False, False]
    issue.issue(10)
    assert issue.done and ends == [None] and ring._unposted[handle.counter_id] == 0
    for layer in range(LAYERS):   # host blocks 2..4 of the layer -> GPU pages 1..3, nothing else touched
        assert (gpu[layer, 1:1 + ROWS] == host[2:2 + ROWS, layer]).all()
        assert not gpu[layer, 0].any() and not gpu[layer, 1 + ROWS:].any()
    kinds = [entry[0] for entry in calls.log]
    assert kinds == ["copy", "record", "wait", "batch"] * LAYERS
    for layer in range(LAYERS):
        copy, record, wait, batch = calls.log[4 * layer:4 * layer + 4]
        assert copy[2:] == (1, 9) and record == ("record", 100 + layer, 9) and wait == ("wait", 55, 100 + layer)
        assert batch == ("batch", 55, ((int(ring.word_addresses[layer]), 41), (int(ring.capture_addresses[layer]), 77)))
    assert ring.words.tolist() == [41] * LAYERS and ring.captures.tolist() == [77] * LAYERS
    assert ring.python_posts == []   # every post was the C loop's
    issue.issue(10)
    assert len(calls.log) == 4 * LAYERS and ends == [None]


@needs_library
def test_an_offload_copies_packed_pages_back_to_pitched_blocks_without_posts():
    host, gpu, run = _pages()
    gpu[:] = np.random.default_rng(1).integers(0, 255, size=gpu.shape, dtype=np.uint8)
    before = host.copy()
    back = RunLayers(run.src_bases, run.src_offset, run.src_pitch, run.dst_bases, run.dst_offset, run.dst_pitch,
                     run.width, run.rows, 2)
    calls, ends = StandIns(), []
    issue = RunIssue(issue_run_fn(), calls.calls, back, LAYERS, None, 0, 3, ends.append)
    issue.issue(10)
    assert [entry[0] for entry in calls.log] == ["copy"] * LAYERS and ends == [None]
    assert all(entry[2:] == (2, 3) for entry in calls.log)
    for layer in range(LAYERS):
        assert (host[2:2 + ROWS, layer] == gpu[layer, 1:1 + ROWS]).all()
    untouched = [b for b in range(BLOCKS) if not 2 <= b < 2 + ROWS]
    assert (host[untouched] == before[untouched]).all()


@needs_library
@pytest.mark.parametrize("call,nth,stage", [("copy", 3, "cudaMemcpy2DAsync"), ("record", 3, "cudaEventRecord"),
                                            ("wait", 3, "cudaStreamWaitEvent"), ("batch", 3, "cuStreamBatchMemOp")])
def test_a_failing_call_stops_at_its_layer_and_poisons_from_there(call, nth, stage):
    _, _, run = _pages()
    ring, calls, ends = NativeRing(), StandIns(fail_at=(call, nth)), []
    handle = ring.acquire()
    issue = RunIssue(issue_run_fn(), calls.calls, run, LAYERS, handle, 0, 9, ends.append)
    issue.issue(10)
    assert issue.done and len(ends) == 1 and isinstance(ends[0], TransferError)
    assert f"issuing layer 2 failed: {stage} returned 7" in str(ends[0])
    assert ring.python_posts == [("poison", (2, 3))]   # layers 0 and 1 were posted by C, the rest poisoned
    assert ring.status[handle.counter_id] != 0
    with pytest.raises(TransferError, match="poisoned"):
        handle.wait_layer(2)


def test_post_native_refuses_a_stale_handle_and_layers_already_posted():
    ring = NativeRing()
    handle = ring.acquire()
    handle.complete_layer(0)
    with pytest.raises(TransferError, match="already posted"):
        handle.post_native(0, 2, lambda posts: 2)
    assert handle.post_native(1, 3, lambda posts: 2) == 2 and ring._posted[handle.counter_id] == [True] * 3 + [False]
    handle.post_native(3, 4, lambda posts: 1)
    handle.release()
    ring.acquire()
    ring.acquire()   # the ring of two went round: `handle`'s counter belongs to another onboarding now
    with pytest.raises(TransferError, match="re-acquired"):
        handle.post_native(0, 1, lambda posts: 1)


def test_a_handle_is_native_capable_only_when_layerwise_on_a_ring_with_native_posts():
    ring = NativeRing()
    assert ring.acquire().native_capable
    assert not ring.acquire(layerwise=False).native_capable


def test_the_issue_path_setting_is_checked(monkeypatch):
    monkeypatch.setenv("LAYERFLOW_RUN_ISSUE", "python")
    assert not native_issue_configured()
    monkeypatch.setenv("LAYERFLOW_RUN_ISSUE", "fast")
    with pytest.raises(ValueError, match="LAYERFLOW_RUN_ISSUE='fast'"):
        native_issue_configured()


@needs_library
def test_a_later_layer_group_posts_its_own_layers():
    host, gpu, run = _pages()
    group = run._replace(dst_bases=run.dst_bases[:2].copy(), src_bases=run.src_bases[:2].copy())
    ring, calls, ends = NativeRing(), StandIns(), []
    handle = ring.acquire()
    issue = RunIssue(issue_run_fn(), calls.calls, group, 2, handle, 2, 9, ends.append)
    issue.issue(1)
    issue.issue(2)
    assert ends == [None] and ring._posted[handle.counter_id] == [False, False, True, True]
    assert [entry[1] for entry in calls.log if entry[0] == "record"] == [102, 103]
    assert ring.words.tolist() == [0, 0, 41, 41] and ring.captures.tolist() == [0, 0, 77, 77]


@pytest.mark.gpu
@pytest.mark.parametrize("lead_layers", [None, 1])
def test_the_cuda_engine_issues_a_run_in_c_as_python_does(lead_layers):
    import torch

    from layerflow.transfer.cuda_copy import CudaCopyEngine
    from layerflow.transfer.signals.waitvalue import WaitValueSignals
    from tests.transfer.pages import LAYERS as PAGE_LAYERS, check_offload_of_new_contents, check_onboarded, \
        make_tensors

    engine = CudaCopyEngine(native_issue=True)
    signals = WaitValueSignals(PAGE_LAYERS, num_counters=2, timeout_s=5.0)
    try:
        gpu, host = make_tensors("cuda")
        if lead_layers is not None:
            engine.lead_bytes = lead_layers * 3 * gpu[0][0].numel() * gpu[0].element_size()
        handle = signals.acquire()
        transfer = engine.onboard(gpu, host, [4, 5, 6], [9, 10, 11], signal=handle, first_layer=0)
        engine.issue_deferred()
        assert signals._posted[handle.counter_id] == [True] * PAGE_LAYERS
        handle.wait(5)   # the counter words reached the epoch: the C loop's stream writes landed
        transfer.wait(5)
        check_onboarded(gpu, host, [4, 5, 6], [9, 10, 11])
        handle.release()
        check_offload_of_new_contents(engine, gpu, host, [2, 3, 4, 5], [12, 13, 14, 15])   # one run, in C
        torch.cuda.synchronize()
    finally:
        signals.close()
        engine.close()
