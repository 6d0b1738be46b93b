"""A bucket's buffers: `fill` writes the batch and clears whatever a larger batch left behind (CPU path); on the GPU
`fetch` waits for the batch's done word, set by every replay of a captured send."""

import pytest
import torch

from layerflow.model import HSTUConfig
from layerflow.model.batch import JaggedBatch
from layerflow.runtime.buffers import BatchBuffers, Bucket

CONFIG = HSTUConfig(num_layers=1, num_heads=1, dqk=8, dv=8, embedding_dim=8, max_seq_len=256, dtype=torch.float32,
                    item_vocab_size=100, position_table_size=256)


def test_fill_writes_the_batch_and_clears_what_a_larger_one_left():
    bufs = BatchBuffers(Bucket(4, 64), 8, torch.device("cpu"), CONFIG)
    big = JaggedBatch.from_lists(CONFIG, [3, 40, 0], [[1, 2], [3, 4, 5], [6]], [[7, 8], [9], [10, 11, 12]])
    bufs.fill(big, [(1, 2), (3, 4, 5, 6), (7,)])
    small = JaggedBatch.from_lists(CONFIG, [10], [[20]], [[30, 31]])
    bufs.fill(small, [(5,)])
    assert (bufs.num_tokens, bufs.num_candidates) == (3, 2)
    assert bufs.q_offsets.tolist() == [0, 3, 3, 3, 3]          # users past the batch own no tokens
    assert bufs.history_lens.tolist() == [11, 0, 0, 0] and bufs.appended_lens.tolist() == [1, 0, 0, 0]
    assert bufs.page_table.tolist() == [[5] + [0] * 7] + [[0] * 8] * 3
    assert bufs.ids.tolist() == [20, 30, 31] + [0] * 61
    assert bufs.positions.tolist() == [10, 11, 11] + [0] * 61
    assert bufs.candidate_rows.tolist() == [1, 2] + [0] * 62
    assert bufs.candidate_ids.tolist() == [30, 31] + [0] * 62


def test_a_returning_users_row_gets_its_new_pages_and_every_other_row_is_rewritten():
    bufs = BatchBuffers(Bucket(3, 64), 6, torch.device("cpu"), CONFIG)
    batch = JaggedBatch.from_lists(CONFIG, [1, 1], [[1], [2]], [[3], [4]])
    one = JaggedBatch.from_lists(CONFIG, [1], [[1]], [[3]])
    steps = [
        (batch, [(4, 5), (9,)], [[4, 5, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0]]),
        (batch, [(4, 5, 6), (9,)], [[4, 5, 6, 0, 0, 0], [9, 0, 0, 0, 0, 0]]),       # pages added
        (batch, [(4, 5, 6), [2, 3]], [[4, 5, 6, 0, 0, 0], [2, 3, 0, 0, 0, 0]]),     # another user (a list)
        (batch, [(4, 7), (2, 3, 1, 0, 8, 9)], [[4, 7, 0, 0, 0, 0], [2, 3, 1, 0, 8, 9]]),   # shorter, then full
        (one, [(4, 7)], [[4, 7, 0, 0, 0, 0], [0] * 6]),                             # a row past the batch
        (batch, [(4, 7), (2, 3)], [[4, 7, 0, 0, 0, 0], [2, 3, 0, 0, 0, 0]]),
    ]
    for jagged, rows, table in steps:
        bufs.fill(jagged, rows)
        assert bufs.page_table.tolist() == table + [[0] * 6], rows


def test_fetch_hands_out_a_copy_the_next_batch_does_not_change():
    bufs = BatchBuffers(Bucket(1, 64), 8, torch.device("cpu"), CONFIG)
    bufs.fill(JaggedBatch.from_lists(CONFIG, [0], [[1]], [[2, 3, 4]]), [(0,)])
    bufs.scores[:3] = torch.tensor([0.5, -1.0, 2.0])
    bufs.send_results()
    first = bufs.fetch()
    bufs.fill(JaggedBatch.from_lists(CONFIG, [0], [[1]], [[5]]), [(0,)])
    bufs.scores[:1] = 9.0
    bufs.send_results()
    assert bufs.fetch().tolist() == [9.0]
    assert first.dtype == torch.float32 and first.tolist() == [0.5, -1.0, 2.0]


@pytest.mark.gpu
def test_fetch_waits_for_a_long_kernel_before_reading_the_scores():
    with torch.cuda.stream(torch.cuda.Stream()):   # the engine's buffers live on a side stream
        bufs = BatchBuffers(Bucket(1, 64), 8, torch.device("cuda"), CONFIG)
    for scores in ([0.5, -1.0, 2.0], [4.0, 3.0, -2.5]):   # the second batch must not see the first one's word
        with torch.cuda.stream(bufs.stream):
            bufs.fill(JaggedBatch.from_lists(CONFIG, [0], [[1]], [[2, 3, 4]]), [(0,)])
            torch.cuda._sleep(50_000_000)   # ~tens of ms on the stream: the scores land well after fetch is called
            bufs.scores[:3] = torch.tensor(scores, device="cuda")
            bufs.send_results()
        assert bufs.fetch().tolist() == scores


@pytest.mark.gpu
def test_the_done_word_is_set_by_every_replay_of_a_captured_send():
    with torch.cuda.stream(torch.cuda.Stream()):   # the engine's buffers live on a side stream (one can capture)
        bufs = BatchBuffers(Bucket(1, 64), 8, torch.device("cuda"), CONFIG)
    value = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(bufs.stream):
        bufs.fill(JaggedBatch.from_lists(CONFIG, [0], [[1]], [[2, 3, 4]]), [(0,)])
        with torch.cuda.graph(graph, stream=bufs.stream):
            torch.cuda._sleep(20_000_000)
            bufs.scores[:3] = value
            bufs.send_results()
        for step in range(1, 4):
            bufs.fill(JaggedBatch.from_lists(CONFIG, [0], [[1]], [[2, 3, 4]]), [(0,)])
            value.fill_(float(step))
            graph.replay()
            assert bufs.fetch().tolist() == [float(step)] * 3
