"""Item ids of a jagged batch: integer-like ids are taken as ints, anything else is refused with a true message."""

import enum

import numpy as np
import pytest
import torch

from layerflow.model.batch import JaggedBatch
from layerflow.model.config import HSTUConfig

CONFIG = HSTUConfig(num_layers=1, num_heads=1, dqk=8, dv=8, embedding_dim=8, max_seq_len=64,
                    dtype=torch.float32, item_vocab_size=10, position_table_size=64)


class Item(enum.IntEnum):
    BOOK = 3
    FILM = 7


def pack(appended, candidates):
    return JaggedBatch.from_lists(CONFIG, [0], [appended], [candidates], user_ids=[42])


def test_integer_like_ids_are_taken_as_ints():
    batch = pack([Item.BOOK, np.int64(5), torch.tensor(2)], [np.uint8(9), Item.FILM, 0])
    assert batch.appended_ids.tolist() == [3, 5, 2]
    assert batch.candidate_ids.tolist() == [9, 7, 0]
    assert pack(np.array([1, 2], dtype=np.int32), []).appended_ids.tolist() == [1, 2]


@pytest.mark.parametrize("bad, message", [
    (1.0, r"user 42: appended item id 1.0 is not an integer \(float\)"),
    ("3", r"user 42: appended item id '3' is not an integer \(str\)"),
    (True, r"user 42: appended item id True is not an integer \(bool\)"),
    (None, r"user 42: appended item id None is not an integer \(NoneType\)"),
    (np.int64(10), r"user 42: appended item id 10 out of vocabulary \[0, 10\)"),
    (Item.FILM + 5, r"user 42: appended item id 12 out of vocabulary"),
    (2**80, r"user 42: appended item id 1208925819614629174706176 out of vocabulary"),
    (-1, r"user 42: appended item id -1 out of vocabulary"),
])
def test_bad_ids_are_refused_with_a_true_message_never_stop_iteration(bad, message):
    with pytest.raises(ValueError, match=message):
        pack([1, bad], [2])


def test_an_int_enum_id_is_accepted_not_a_stop_iteration():
    batch = pack([Item.BOOK], [Item.FILM])
    assert (batch.appended_ids.tolist(), batch.candidate_ids.tolist()) == ([3], [7])


def test_an_int_enum_out_of_vocabulary_is_named_by_its_value():
    class Far(enum.IntEnum):
        AWAY = 11

    with pytest.raises(ValueError, match=r"candidate item id 11 out of vocabulary"):
        pack([1], [Far.AWAY])


def test_a_bad_id_in_a_batch_of_plain_ints_names_its_user():
    lists = dict(cached_lens=[0, 0, 0], appended=[[1, 2], [3], [4]], candidates=[[5], [6, 7], [8]],
                 user_ids=[11, 12, 13])
    batch = JaggedBatch.from_lists(CONFIG, **lists)   # converted and checked at once
    assert batch.appended_ids.tolist() == [1, 2, 3, 4] and batch.candidate_ids.tolist() == [5, 6, 7, 8]
    lists["candidates"][2] = [10]
    with pytest.raises(ValueError, match=r"user 13: candidate item id 10 out of vocabulary"):
        JaggedBatch.from_lists(CONFIG, **lists)
    lists["candidates"][2], lists["appended"][1] = [8], [3, -4]
    with pytest.raises(ValueError, match=r"user 12: appended item id -4 out of vocabulary"):
        JaggedBatch.from_lists(CONFIG, **lists)


def test_plain_ints_vouched_for_skip_the_type_scan_but_not_the_vocabulary():
    """`plain_ints` (the KV manager's batches of Request lists): the same batch; an id out of the vocabulary or past
    int64 is still named with its user."""
    lists = dict(cached_lens=[3, 0], appended=[[1, 2], [3]], candidates=[[5], [6, 7]], user_ids=[11, 12])
    batch, scanned = JaggedBatch.from_lists(CONFIG, **lists, plain_ints=True), JaggedBatch.from_lists(CONFIG, **lists)
    assert batch.appended_ids.tolist() == scanned.appended_ids.tolist() == [1, 2, 3]
    assert batch.candidate_ids.tolist() == scanned.candidate_ids.tolist() == [5, 6, 7]
    assert batch.cached_lens == [3, 0] and batch.candidate_lens == [1, 2]
    for bad, match in ((10, "user 12: candidate item id 10 out of vocabulary"),
                       (2**80, "user 12: candidate item id 1208925819614629174706176 out of vocabulary")):
        lists["candidates"][1] = [6, bad]
        with pytest.raises(ValueError, match=match):
            JaggedBatch.from_lists(CONFIG, **lists, plain_ints=True)


def test_the_id_arrays_are_the_id_tensors_memory():
    batch = JaggedBatch.from_lists(CONFIG, [0, 2], [[1, 2], [3]], [[4], [5, 6]])
    built = JaggedBatch(batch.cached_lens, batch.appended_lens, batch.candidate_lens, batch.appended_ids.clone(),
                        batch.candidate_ids.clone())
    for b in (batch, built):
        appended, candidates = b.id_arrays()
        assert appended.tolist() == [1, 2, 3] and candidates.tolist() == [4, 5, 6]
        assert appended.dtype == candidates.dtype == np.int64
        b.candidate_ids[0] = 9
        assert candidates[0] == 9
