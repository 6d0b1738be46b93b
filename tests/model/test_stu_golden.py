"""Every STU golden case (generative-recommenders' own outputs) reproduced through the gr-stu importer and the
reference math, with GR's batch 1/N rule; and what layerflow's constant rule gives on the same weights.

Tolerance: the largest difference relative to the case's largest output. Float32: 3e-6 (measured at most 8.2e-7, on
dlrmv3-shape; BLAS order differs from the generating machine). Float64: 1e-7 (measured 3.1e-8): that GR path rounds
its norms through float32, which this reference does too.
"""

from __future__ import annotations

import pytest
import torch

from layerflow.model import HSTUWeights
from layerflow.model.checkpoint import ModelOptions, import_checkpoint, import_state_dict
from layerflow.model.reference import PrefillOutput, StepOutput, batch_n, cached_step, prefill
from tests.model.golden import CASES, GoldenCase, fixtures_dir, load_case

RELATIVE_TOLERANCE = {torch.float32: 3e-6, torch.float64: 1e-7}
MAX_SEQ_LEN = 2048
INT8_CASE = "dlrmv3-shape"   # its two big matrices are stored as int8 with a scale (see the fixtures' README)


def options(case: GoldenCase, rule: str) -> ModelOptions:
    c = case.meta["stu_layer_config"]
    return ModelOptions(num_heads=c["num_heads"], max_seq_len=MAX_SEQ_LEN, contextual_len=c["contextual_seq_len"],
                        max_attn_len=c["max_attn_len"], attn_alpha=c["attn_alpha"], attn_n_rule=rule)


def imported(case: GoldenCase, rule: str) -> HSTUWeights:
    return import_state_dict("gr-stu", case.state_dict, options(case, rule))


def run(weights: HSTUWeights, case: GoldenCase, prefill_n: float | None = None) -> tuple[PrefillOutput, StepOutput]:
    cached, appended, candidates = case.lengths()
    first = prefill(weights, case.tensors["inputs.history_x"], cached, n=prefill_n)
    step = cached_step(weights, first.history_k, first.history_v, cached, case.tensors["inputs.delta_x"], appended,
                       candidates)
    return first, step


def full_delta(weights: HSTUWeights, case: GoldenCase) -> torch.Tensor:
    """Each user's [history ; delta] through one uncached forward, its last D rows (GR's step c)."""
    cached, _, candidates = case.lengths()
    d = case.meta["delta_size"]
    history, delta = case.tensors["inputs.history_x"], case.tensors["inputs.delta_x"]
    offsets = case.tensors["inputs.history_offsets"].tolist()
    x = torch.cat([torch.cat([history[lo:hi], delta[b * d:(b + 1) * d]])
                   for b, (lo, hi) in enumerate(zip(offsets, offsets[1:]))])
    out = prefill(weights, x, [c + d for c in cached], candidates).outputs
    ends = torch.tensor([c + d for c in cached]).cumsum(0).tolist()
    return torch.cat([out[end - d:end] for end in ends])


def assert_matches(got: torch.Tensor, want: torch.Tensor, case: GoldenCase, what: str) -> None:
    scale = case.tensors["outputs.full_delta"].abs().max().item()
    error = (got - want).abs().max().item()
    limit = RELATIVE_TOLERANCE[want.dtype] * scale
    assert error <= limit, f"{case.name} {what}: max abs error {error:.3g} > {limit:.3g}"


@pytest.fixture(scope="module", params=CASES)
def case(request) -> GoldenCase:
    return load_case(request.param)


def test_importer_infers_the_case_shape(case):
    config = imported(case, "batch").config
    c = case.meta["stu_layer_config"]
    assert (config.family, config.num_layers, config.num_heads, config.dqk, config.dv, config.embedding_dim) == (
        "stu", case.meta["num_layers"], c["num_heads"], c["attention_dim"], c["hidden_dim"], c["embedding_dim"])
    assert config.output_norm == ("group" if c["use_group_norm"] else "layer")
    assert config.dtype == getattr(torch, case.meta["dtype"]) and not config.embedding_tables
    assert config.alpha == pytest.approx(c["attn_alpha_effective"], rel=1e-15)


def test_prefill_and_cached_step_reproduce_gr(case):
    weights = imported(case, "batch")
    cached, appended, candidates = case.lengths()
    assert batch_n(weights.config, [], cached) == case.meta["prefill_max_seq_len"]
    assert batch_n(weights.config, cached, [a + k for a, k in zip(appended, candidates)]) == \
        case.meta["cached_max_seq_len"]
    first, step = run(weights, case)
    assert_matches(first.outputs, case.tensors["outputs.prefill"], case, "prefill")
    assert_matches(step.outputs, case.tensors["outputs.cached"], case, "cached step")


def test_full_forward_and_full_n_prefill_reproduce_gr(case):
    weights = imported(case, "batch")
    assert_matches(full_delta(weights, case), case.tensors["outputs.full_delta"], case, "full run")
    _, step = run(weights, case, prefill_n=case.meta["full_max_seq_len"])
    assert_matches(step.outputs, case.tensors["outputs.cached_prefillN_full"], case, "prefill with the full N")


def test_constant_rule_cached_step_equals_full_recompute_without_contextual_prefix(case):
    """N = max_seq_len for every call: the cached K/V stay valid, so the cached step is a full recompute, except
    where a contextual prefix would have seen the delta's new history (the only-candidates user stays exact)."""
    weights = imported(case, "constant")
    _, step = run(weights, case)
    full = full_delta(weights, case)
    d = case.meta["delta_size"]
    _, appended, _ = case.lengths()
    for b, new in enumerate(appended):
        rows = slice(b * d, (b + 1) * d)
        error = (step.outputs[rows] - full[rows]).abs().max().item()
        if weights.config.contextual_len and new:
            assert error > 1e-4, f"{case.name} user {b}: cached step unexpectedly equals the full run"
        else:
            assert error <= RELATIVE_TOLERANCE[full.dtype] * full.abs().max().item(), f"{case.name} user {b}"


@pytest.mark.parametrize("name", [name for name in CASES if name != INT8_CASE])
def test_imported_file_loads_without_a_config(name, tmp_path):
    """The CLI's library path on a fixture file itself: its inputs and outputs lie outside the stack's prefix."""
    case = load_case(name)
    path = tmp_path / "model.safetensors"
    written = import_checkpoint("gr-stu", fixtures_dir() / f"{name}.safetensors", path, options(case, "batch"))
    loaded = HSTUWeights.load(path)
    assert loaded.config == written.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), written.state_dict().values()))
    _, step = run(loaded, case)
    assert_matches(step.outputs, case.tensors["outputs.cached"], case, "cached step")


def test_int8_stored_file_is_refused_naming_the_dtypes(tmp_path):
    """The importer converts no quantised storage: the fixture's scales are applied by the test (GoldenCase)."""
    src, out, opts = fixtures_dir() / f"{INT8_CASE}.safetensors", tmp_path / "m.safetensors", options(
        load_case(INT8_CASE), "batch")
    with pytest.raises(ValueError, match=r"several layer stacks \['_stu_layers.', 'param_scale._stu_layers.'\]"):
        import_checkpoint("gr-stu", src, out, opts)
    with pytest.raises(ValueError, match=r"several dtypes: torch.float32 .*, torch.int8 \(e.g. _stu_layers.0._output_weight\)"):
        import_checkpoint("gr-stu", src, out, opts, prefix="_stu_layers.")
