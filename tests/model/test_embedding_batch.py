"""Token embeddings of a jagged batch: non-finite rows are refused with the user and the kind named, whatever the
dtype, and the bit test that finds them agrees with torch.isfinite on every bfloat16 and float16 bit pattern."""

import pytest
import torch

from layerflow.model.batch import JaggedBatch, _all_finite
from layerflow.model.config import HSTUConfig

CONFIG = HSTUConfig(num_layers=1, num_heads=1, dqk=8, dv=8, embedding_dim=4, max_seq_len=64, dtype=torch.bfloat16,
                    item_vocab_size=0, position_table_size=0, family="stu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_half_width_bit_pattern_agrees_with_isfinite(dtype):
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns)
    assert [_all_finite(patterns[i:i + 1]) for i in range(0, len(patterns), 61)] == finite[::61].tolist()
    assert not _all_finite(patterns)
    assert _all_finite(patterns[finite])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_one_non_finite_value_is_found_in_any_layout(dtype, bad):
    x = torch.randn(6, 5).to(dtype)
    assert _all_finite(x) and _all_finite(x.t()) and _all_finite(x[:0])
    x[4, 1] = bad
    assert not _all_finite(x) and not _all_finite(x.t()) and not _all_finite(x[:, 1:3])
    assert _all_finite(x[:, 2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_embedding_names_its_user_and_kind(dtype):
    rows = torch.ones(3, 4, dtype=dtype)
    bad = rows.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=f"user 9: candidate embeddings must be finite floats, got {dtype}"):
        JaggedBatch.from_embeddings(CONFIG, [0, 0], [rows, rows], [rows, bad], user_ids=[8, 9])
    batch = JaggedBatch.from_embeddings(CONFIG, [0], [rows], [rows.t().contiguous().t()], user_ids=[8])
    assert batch.query_x.dtype == torch.bfloat16 and batch.query_x.shape == (6, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_query_rows_are_the_users_rows_in_batch_order(dtype):
    config = HSTUConfig(num_layers=1, num_heads=1, dqk=8, dv=8, embedding_dim=4, max_seq_len=64, dtype=dtype,
                        item_vocab_size=0, position_table_size=0, family="stu")
    gen = torch.Generator().manual_seed(1)
    appended = [torch.randn(2, 4, generator=gen), torch.randn(0, 4, generator=gen).to(dtype)]
    candidates = [torch.randn(4, 3, generator=gen).t().to(torch.float64), torch.randn(5, 4, generator=gen)]
    batch = JaggedBatch.from_embeddings(config, [0, 3], appended, candidates)
    expected = torch.cat([t.to(dtype) for t in (appended[0], candidates[0], appended[1], candidates[1])])
    assert batch.query_x.dtype == dtype
    assert torch.equal(batch.query_x.view(torch.uint8), expected.view(torch.uint8))
