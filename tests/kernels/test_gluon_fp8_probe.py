"""The fp8 Gluon kernel's decode probes (benchmarks/fp8_decode_probe.py): a probe replaces the decode of history tiles
only, so a user without history gets the real kernel's rows bit for bit and a user with history does not; a probe
name it does not know is refused by name."""

import pytest
import torch

from benchmarks.fp8_decode_probe import PROBES, Fp8DecodeProbe
from layerflow.kernels.gluon_fp8 import Fp8Tiling, default_fp8_tiling
from tests.kernels.test_gluon_fp8_gpu import E4M3, attention, fp8_batch


def test_an_unknown_probe_is_named():
    with pytest.raises(ValueError, match="probe='convert'"):
        Fp8DecodeProbe(Fp8Tiling(), "convert")


def test_a_probe_keeps_the_tiling_and_is_a_launcher_of_its_own():
    tiling = default_fp8_tiling(256, 64)
    probes = [Fp8DecodeProbe(tiling, name) for name in PROBES]
    assert all(p.tiling == tiling for p in probes)
    assert len({p._launch.__func__ for p in probes}) == len(PROBES)


@pytest.mark.gpu
@pytest.mark.parametrize("probe", sorted(PROBES))
@pytest.mark.parametrize("candidates", [0, 256])
def test_a_probe_changes_the_rows_of_users_with_history_only(probe, candidates):
    batch = fp8_batch([0, 4096 + 64], [64, 64], [candidates, candidates], 256, E4M3)
    attn = attention(batch, "gluon", 256, E4M3)

    def rows() -> torch.Tensor:
        out = attn.run(batch.q, batch.k, batch.v, batch.kv_cache, *batch.lengths, torch.zeros_like(batch.q))
        return out[:batch.total_tokens]

    real = rows()
    attn.gluon = Fp8DecodeProbe(attn.gluon.tiling, probe)
    probed = rows()
    first = 64 + candidates
    assert torch.equal(probed[:first], real[:first])
    assert not torch.equal(probed[first:], real[first:])
