"""A sliding window pays (issue 17.5): a cached step under max_attn_len W reads only its last pages, so an onboarding
copies only those; the scores still equal a full recompute, also when a later step's window starts earlier than the
pages the GPU holds (the user is then served from the tier below again, or recomputed)."""

import torch

from layerflow.bench.recording import BenchCopyEngine
from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights, full_forward
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.transfer.thread_copy import ThreadCopyEngine

WINDOW = 40
PAGE = 16
CONFIG = HSTUConfig(num_layers=2, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=1024,
                    dtype=torch.float32, item_vocab_size=500, position_table_size=1024, max_attn_len=WINDOW)


def test_a_windowed_step_onboards_only_the_pages_it_reads_and_scores_exactly():
    weights = HSTUWeights.init(CONFIG, seed=8)
    copier = BenchCopyEngine(ThreadCopyEngine())
    history = [i % 500 for i in range(300)]
    config = Config(page_size=PAGE, gpu_cache_gb=0.01, cpu_cache_gb=0.01)
    with Engine(weights, config, device="cpu", copy_engine=copier) as engine:
        engine.score([Request(1, history, [])])
        engine.kv.evict_from_gpu(1)
        copier.forget()
        scores = engine.score([Request(1, [7, 8], [9, 10])])[0]
        history += [7, 8]
        ref = full_forward(weights, [history], [[9, 10]]).scores
        assert torch.allclose(scores, ref, atol=1e-5, rtol=1e-5)
        (onboarding,) = copier.onboardings
        first = (300 - WINDOW) // PAGE                   # the step's first token is position 300: it reads 260..
        assert list(onboarding.gpu_pages) == list(engine.kv.gpu.pages(1)[first:-(-300 // PAGE)])
        assert len(onboarding.gpu_pages) == 19 - first < 19 // 3
        assert engine.kv.users[1].gpu_first_page == first

        engine.kv.wait_offloads()
        engine.kv.truncate(1, 150)                       # the next step reads from 110: before the GPU's valid pages
        del history[150:]
        assert engine.kv.tier(1) is Tier.GPU
        scores = engine.score([Request(1, [3], [4])])[0]
        history += [3]
        ref = full_forward(weights, [history], [[4]]).scores
        assert torch.allclose(scores, ref, atol=1e-5, rtol=1e-5)
