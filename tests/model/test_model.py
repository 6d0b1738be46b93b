"""The model's cached path equals a full recompute, and its inputs are validated."""

import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from layerflow.model import HSTUConfig, HSTUWeights, JaggedBatch, cached_forward, full_forward

TOL = 1e-5


def _past(weights, cache, users):
    """Concatenate the given users' cached K/V per layer (cache[user] = (list of K, list of V))."""
    cfg = weights.config
    ks = [torch.cat([cache[u][0][l] for u in users]) if users else torch.zeros(0, cfg.num_heads, cfg.dqk)
          for l in range(cfg.num_layers)]
    vs = [torch.cat([cache[u][1][l] for u in users]) if users else torch.zeros(0, cfg.num_heads, cfg.dv)
          for l in range(cfg.num_layers)]
    return ks, vs


def _empty_cache(cfg):
    return ([torch.zeros(0, cfg.num_heads, cfg.dqk)] * cfg.num_layers,
            [torch.zeros(0, cfg.num_heads, cfg.dv)] * cfg.num_layers)


CACHE_EXACT = {
    "hstu": {},
    "hstu-window": dict(max_attn_len=40),
    "stu-group-window": dict(family="stu", output_norm="group", max_attn_len=40, attn_alpha=0.3),
}


@pytest.mark.parametrize("options", list(CACHE_EXACT))
def test_cached_equals_full_over_append_steps(small_config, options):
    """With the constant 1/N and no contextual prefix the cached path is cache-exact, for both families."""
    cfg = HSTUConfig(**{**small_config.to_dict(), **CACHE_EXACT[options]})
    small_weights = HSTUWeights.init(cfg, seed=0)
    rng = random.Random(1)
    steps = [1, 37, 300]  # history length after each step: page-unaligned
    users = [0, 1]
    history = {u: [] for u in users}
    cache = {u: _empty_cache(cfg) for u in users}
    for target in steps:
        appended = [[rng.randrange(cfg.item_vocab_size) for _ in range(target - len(history[u]) - u)] for u in users]
        cands = [[rng.randrange(cfg.item_vocab_size) for _ in range(5 + u)] for u in users]
        batch = JaggedBatch.from_lists(cfg, [len(history[u]) for u in users], appended, cands)
        out = cached_forward(small_weights, batch, *_past(small_weights, cache, users))
        for u in users:
            history[u] += appended[u]
        full = full_forward(small_weights, [history[u] for u in users], cands)
        assert (out.scores - full.scores).abs().max() <= TOL * max(1.0, full.scores.abs().max())
        assert (out.candidate_outputs - full.candidate_outputs).abs().max() <= TOL * 10
        ao = batch.appended_offsets.tolist()
        for l in range(cfg.num_layers):
            for u in users:
                k_u, v_u = out.new_k[l][ao[u]:ao[u + 1]], out.new_v[l][ao[u]:ao[u + 1]]
                cache[u][0][l] = torch.cat([cache[u][0][l], k_u])
                cache[u][1][l] = torch.cat([cache[u][1][l], v_u])
        fo = [0]
        for u in users:
            fo.append(fo[-1] + len(history[u]))
        for l in range(cfg.num_layers):
            for u in users:
                assert torch.allclose(cache[u][0][l], full.history_k[l][fo[u]:fo[u + 1]], atol=TOL)
                assert torch.allclose(cache[u][1][l], full.history_v[l][fo[u]:fo[u + 1]], atol=TOL)


def _one_user(weights, cached_len, appended, cands):
    cfg = weights.config
    rng = torch.Generator().manual_seed(cached_len)
    past = ([torch.randn(cached_len, cfg.num_heads, cfg.dqk, generator=rng) for _ in range(cfg.num_layers)],
            [torch.randn(cached_len, cfg.num_heads, cfg.dv, generator=rng) for _ in range(cfg.num_layers)])
    return past


def test_candidate_score_independent_of_other_candidates(small_weights):
    cfg = small_weights.config
    past = _one_user(small_weights, 40, [], [])
    cands = list(range(100, 120))
    base = cached_forward(small_weights, JaggedBatch.from_lists(cfg, [40], [[3, 4, 5]], [cands]), *past).scores
    perm = list(range(20))
    random.Random(0).shuffle(perm)
    shuffled = cached_forward(small_weights, JaggedBatch.from_lists(cfg, [40], [[3, 4, 5]], [[cands[i] for i in perm]]),
                              *past).scores
    assert torch.allclose(shuffled, base[perm], atol=TOL)
    kept = perm[:7]
    dropped = cached_forward(small_weights, JaggedBatch.from_lists(cfg, [40], [[3, 4, 5]], [[cands[i] for i in kept]]),
                             *past).scores
    assert torch.allclose(dropped, base[kept], atol=TOL)


def test_user_result_independent_of_batch(small_weights):
    cfg = small_weights.config
    gen = torch.Generator().manual_seed(3)
    lens = [0, 17, 64, 5]
    past = {b: ([torch.randn(n, cfg.num_heads, cfg.dqk, generator=gen) for _ in range(cfg.num_layers)],
                [torch.randn(n, cfg.num_heads, cfg.dv, generator=gen) for _ in range(cfg.num_layers)])
            for b, n in enumerate(lens)}
    appended = [[1, 2], [], [9] * 33, [4]]
    cands = [[10, 11, 12], [13], [14, 15], []]

    def run(users):
        batch = JaggedBatch.from_lists(cfg, [lens[b] for b in users], [appended[b] for b in users],
                                       [cands[b] for b in users])
        ks = [torch.cat([past[b][0][l] for b in users]) for l in range(cfg.num_layers)]
        vs = [torch.cat([past[b][1][l] for b in users]) for l in range(cfg.num_layers)]
        out = cached_forward(small_weights, batch, ks, vs)
        co = batch.candidate_offsets.tolist()
        return {b: out.scores[co[i]:co[i + 1]] for i, b in enumerate(users)}

    together = run([0, 1, 2, 3])
    for order in ([2], [3, 1], [1, 0, 2]):
        alone = run(order)
        for b in order:
            assert torch.allclose(alone[b], together[b], atol=TOL)


def test_zero_history_and_zero_candidates(small_weights):
    cfg = small_weights.config
    full = full_forward(small_weights, [[]], [[5, 6]])
    out = cached_forward(small_weights, JaggedBatch.from_lists(cfg, [0], [[]], [[5, 6]]), *_empty_cache(cfg))
    assert out.scores.shape == (2,) and torch.allclose(out.scores, full.scores, atol=TOL)
    none = cached_forward(small_weights, JaggedBatch.from_lists(cfg, [0], [[1, 2, 3]], [[]]), *_empty_cache(cfg))
    assert none.scores.shape == (0,) and none.new_k[0].shape == (3, cfg.num_heads, cfg.dqk)
    assert torch.allclose(none.new_k[1], full_forward(small_weights, [[1, 2, 3]], [[]]).history_k[1], atol=TOL)


def test_save_load_bit_exact(tmp_path, small_weights):
    path = tmp_path / "w.safetensors"
    small_weights.save(path)
    loaded = HSTUWeights.load(path, small_weights.config)
    a, b = small_weights.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_init_is_deterministic_and_seeded(small_config):
    a = HSTUWeights.init(small_config, seed=5).state_dict()
    b = HSTUWeights.init(small_config, seed=5).state_dict()
    c = HSTUWeights.init(small_config, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.uvqk.weight"], c["layers.0.uvqk.weight"])


def test_load_rejects_mismatched_config(tmp_path, small_weights, small_config):
    path = tmp_path / "w.safetensors"
    small_weights.save(path)
    wider = HSTUConfig(**{**small_config.to_dict(), "embedding_dim": 64})
    with pytest.raises(ValueError, match=r"config differs from the file's.*'embedding_dim': \(64, 32\)"):
        HSTUWeights.load(path, wider)


def test_load_without_metadata_checks_tensors_against_the_config(tmp_path, small_weights, small_config):
    path = tmp_path / "bare.safetensors"
    save_file({k: v.contiguous() for k, v in small_weights.state_dict().items()}, str(path))
    with pytest.raises(ValueError, match="no 'hstu_config' metadata"):
        HSTUWeights.load(path)
    assert HSTUWeights.load(path, small_config).config == small_config
    wider = HSTUConfig(**{**small_config.to_dict(), "embedding_dim": 64})
    with pytest.raises(ValueError, match="item_embedding has shape"):
        HSTUWeights.load(path, wider)
    deeper = HSTUConfig(**{**small_config.to_dict(), "num_layers": 3})
    with pytest.raises(ValueError, match="missing"):
        HSTUWeights.load(path, deeper)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("num_heads", -1), ("dqk", 2.5), ("dtype", "int8"),
                                         ("max_seq_len", True)])
def test_config_rejects_bad_values(small_config, field, value):
    with pytest.raises(ValueError, match=field if field != "dtype" else "dtype"):
        HSTUConfig(**{**small_config.to_dict(), field: value})


def test_config_rejects_short_position_table(small_config):
    with pytest.raises(ValueError, match="position_table_size=100"):
        HSTUConfig(**{**small_config.to_dict(), "position_table_size": 100})


@pytest.mark.parametrize("cached,appended,cands,match", [
    ([-1], [[1]], [[2]], "cached_len=-1"),
    ([0], [[1], [2]], [[3]], "batch sizes disagree"),
    ([0], [[1000]], [[2]], "item id 1000"),
    ([0], [[1]], [[-3]], "item id -3"),
    ([500], [[1] * 10], [[2] * 3], "total length 513"),
    ([0], [[1, True]], [[2]], "appended item id True"),
    ([0], [[1]], [[2, 3.0]], "candidate item id 3.0"),
    ([0], [[2 ** 70]], [[2]], f"item id {2 ** 70}"),
])
def test_batch_rejects_bad_inputs(small_config, cached, appended, cands, match):
    with pytest.raises(ValueError, match=match):
        JaggedBatch.from_lists(small_config, cached, appended, cands)


def test_cached_forward_rejects_bad_cache(small_weights):
    cfg = small_weights.config
    batch = JaggedBatch.from_lists(cfg, [4], [[1]], [[2]])
    good = _one_user(small_weights, 4, [], [])
    with pytest.raises(ValueError, match=r"layer 0 cached K shape \(3, 2, 16\)"):
        cached_forward(small_weights, batch, [good[0][0][:3], good[0][1]], good[1])
    with pytest.raises(ValueError, match="dtype torch.float16"):
        cached_forward(small_weights, batch, [t.half() for t in good[0]], good[1])
    with pytest.raises(ValueError, match="cover 1/2 layers"):
        cached_forward(small_weights, batch, good[0][:1], good[1])


def test_query_arrays_follow_the_jagged_order(small_config):
    """Per user: its appended tokens at cached_len + j, then its candidates at the history length; users with no
    appended items or no candidates included."""
    cached, appended, cands = [5, 0, 7, 3], [[1, 2], [3], [], [4, 5, 6]], [[7], [], [8, 9], []]
    batch = JaggedBatch.from_lists(small_config, cached, appended, cands)
    ids, positions, is_candidate = batch.query_arrays()
    want_ids, want_pos, want_cand = [], [], []
    for c, a, k in zip(cached, appended, cands):
        want_ids += a + k
        want_pos += list(range(c, c + len(a))) + [c + len(a)] * len(k)
        want_cand += [False] * len(a) + [True] * len(k)
    assert ids.tolist() == want_ids and positions.tolist() == want_pos and is_candidate.tolist() == want_cand
    tok_ids, tok_pos = batch.query_tokens()
    assert tok_ids.tolist() == want_ids and tok_pos.tolist() == want_pos
    assert batch.candidate_mask().tolist() == want_cand


def test_pack_query_writes_the_jagged_order_into_the_fronts_of_larger_arrays(small_config):
    cached, appended, cands = [5, 0, 7], [[1, 2], [3], []], [[7], [], [8, 9]]
    batch = JaggedBatch.from_lists(small_config, cached, appended, cands)
    ids, positions, is_candidate = batch.query_arrays()
    out = [np.full(16, -1, dtype=np.int32) for _ in range(3)]
    assert batch.pack_query(*out) == len(ids) == 6
    assert out[0][:6].tolist() == ids.tolist() and out[1][:6].tolist() == positions.tolist()
    assert out[2][:3].tolist() == np.flatnonzero(is_candidate).tolist() == [2, 4, 5]
    assert set(out[0][6:]) == set(out[1][6:]) == set(out[2][3:]) == {-1}   # nothing written past the batch
