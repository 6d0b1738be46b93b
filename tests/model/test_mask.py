"""The mask rule against GR's definition written out pair by pair, the README's worked example, and the window
helper against the mask's own columns."""

import itertools

import pytest
import torch

from layerflow.model.mask import MaskRule, attention_mask, cached_read_range


def literal_mask(n: int, c: int, t: int, w: int) -> torch.Tensor:
    """The fixtures' README rule, one pair at a time."""
    ids = [max(p - c + 1, 0) if c else p for p in range(n)]
    m = n - c + 1 - t if c else n - t
    ids = [min(i, m) for i in ids]
    out = torch.zeros(n, n, dtype=torch.bool)
    for i, j in itertools.product(range(n), range(n)):
        seen = (i == j or ids[i] > ids[j]) and (w == 0 or ids[i] - ids[j] <= w)
        out[i, j] = seen or (c > 0 and ids[i] == 0 and ids[j] < m)
    return out


def test_readme_example():
    rows = ["xxxxxxx..", "xxxxxxx..", "xxx......", "xxxx.....", "xxxxx....", "..xxxx...", "...xxxx..",
            "....xxxx.", "....xxx.x"]
    want = torch.tensor([[ch == "x" for ch in row] for row in rows])
    assert torch.equal(MaskRule(contextual_len=2, max_attn_len=3).full_mask(7, 2), want)


@pytest.mark.parametrize("c,w", [(0, 0), (1, 0), (3, 0), (0, 2), (3, 2), (4, 7), (2, 1)])
def test_full_mask_is_the_literal_rule(c, w):
    rule = MaskRule(contextual_len=c, max_attn_len=w)
    for history, targets in itertools.product(range(0, 12), range(0, 4)):
        assert torch.equal(rule.full_mask(history, targets), literal_mask(history + targets, c, targets, w)), \
            (history, targets)


def test_target_unaware_candidates_are_causal():
    mask = MaskRule(target_aware=False).full_mask(3, 2)
    assert torch.equal(mask, torch.ones(5, 5, dtype=torch.bool).tril())


def test_default_rule_is_causal_history_and_self_seeing_candidates():
    mask = attention_mask(4, 2, 3)
    assert mask.shape == (5, 7)
    assert torch.equal(mask[:2, :4], torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))
    assert mask[2:, :4].all() and not mask[:2, 4:].any()
    assert torch.equal(mask[2:, 4:], torch.eye(3, dtype=torch.bool))


@pytest.mark.parametrize("c,w", [(0, 0), (0, 5), (3, 5), (6, 4), (1, 1), (3, 0)])
def test_cached_read_range_is_the_columns_the_step_reads(c, w):
    rule = MaskRule(contextual_len=c, max_attn_len=w)
    for cached, appended, candidates in itertools.product(range(0, 25, 3), range(0, 4), range(0, 3)):
        read = attention_mask(cached + appended, appended, candidates, rule)[:, :cached].any(0)
        got = cached_read_range(rule, cached, appended, candidates)
        assert not read[:got.start].any(), (cached, appended, candidates)
        # Every position from the start on is read, except where a history shorter than the prefix sees only itself.
        if cached + appended >= c:
            assert read[got.start:].all(), (cached, appended, candidates)
        assert got.stop == cached


@pytest.mark.parametrize("field,value", [("contextual_len", -1), ("max_attn_len", 1.5), ("target_aware", 1)])
def test_rule_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        MaskRule(**{field: value})
