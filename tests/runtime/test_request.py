"""Request: the user id and the item lists are normalised to plain ints, anything else is refused naming it."""

import enum

import numpy as np
import pytest
import torch

from layerflow.runtime.request import Request


class User(enum.IntEnum):
    ALICE = 1


def test_integer_like_user_ids_and_items_become_plain_ints_and_lists():
    r = Request(np.int64(7), (1, np.int32(2)), np.array([3, 4]))
    assert type(r.user_id) is int and r.user_id == 7
    assert r.items == [1, 2] and all(type(i) is int for i in r.items)
    assert r.candidates == [3, 4] and all(type(i) is int for i in r.candidates)
    assert type(Request(User.ALICE, [], []).user_id) is int
    assert Request(torch.tensor(5), torch.tensor([6, 7]), []).items == [6, 7]
    assert Request(2**63 - 1, [], []).user_id == 2**63 - 1


@pytest.mark.parametrize("bad, message", [
    (True, r"user_id=True: must be an integer in \[0, 2\*\*63\), not bool"),
    (1.0, r"user_id=1.0: must be an integer in \[0, 2\*\*63\), not float"),
    (None, r"user_id=None: must be an integer"),
    ("1", r"user_id='1': must be an integer"),
    (2**80, r"user_id=1208925819614629174706176: must be an integer in \[0, 2\*\*63\)"),
    (-1, r"user_id=-1: must be an integer in \[0, 2\*\*63\)"),
])
def test_bad_user_ids_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        Request(bad, [1], [2])


@pytest.mark.parametrize("field, items, candidates", [("items", [1, 2.0], []), ("candidates", [], [False])])
def test_non_integer_items_are_refused_naming_the_list_and_value(field, items, candidates):
    with pytest.raises(ValueError, match=rf"user 3: {field}\[\d\]=(2.0|False) is not an integer"):
        Request(3, items, candidates)


def test_a_request_keeps_its_own_copy_of_the_lists():
    items = [1, 2]
    r = Request(0, items, [])
    items.append(3)
    assert r.items == [1, 2]
