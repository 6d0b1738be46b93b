"""KV pages for copy-engine tests: a GPU layer set poisoned outside what a transfer writes, a random host block
tensor, placements, and byte-exact checks of both directions."""

import torch

LAYERS, PAGES, BLOCKS, PAGE, HEADS, DIM = 3, 24, 20, 4, 2, 8
POISON = -7.0


def make_tensors(device="cpu", pages=PAGES, blocks=BLOCKS, layers=LAYERS, page=PAGE, heads=HEADS, dim=DIM,
                 dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    host = torch.randn((blocks, layers, 2, page, heads, dim), generator=gen).to(dtype)
    if device != "cpu":
        host = host.pin_memory()
    gpu = [torch.full((pages, 2, page, heads, dim), POISON, dtype=dtype, device=device) for _ in range(layers)]
    return gpu, host


PLACEMENTS = {
    "contiguous": (list(range(3, 13)), list(range(5, 15))),
    "fragmented": ([7, 8, 2, 3, 4, 19, 0, 11, 12, 13, 23], [1, 2, 9, 10, 11, 3, 17, 4, 5, 6, 0]),
}


def check_onboarded(gpu, host, pages, blocks):
    for layer, tensor in enumerate(gpu):
        got = tensor.cpu()
        for page, block in zip(pages, blocks):
            assert torch.equal(got[page], host[block, layer]), (layer, page, block)
        untouched = sorted(set(range(tensor.shape[0])) - set(pages))
        assert bool((got[untouched] == POISON).all()), f"layer {layer}: a page outside the transfer was written"


def check_offloaded(gpu, host, before, pages, blocks):
    for layer, tensor in enumerate(gpu):
        src = tensor.cpu()
        for page, block in zip(pages, blocks):
            assert torch.equal(host[block, layer], src[page]), (layer, page, block)
    untouched = sorted(set(range(host.shape[0])) - set(blocks))
    assert torch.equal(host[untouched], before[untouched]), "a block outside the transfer was written"


def check_offload_of_new_contents(engine, gpu, host, pages, blocks):
    """Fresh random GPU layers offloaded by `engine` land in exactly the blocks named, byte-exact."""
    for layer in gpu:
        layer.copy_(torch.randn(layer.shape, device=layer.device))
    before = host.clone()
    transfer = engine.offload(gpu, host, pages, blocks)
    transfer.wait(10)
    assert transfer.done() and transfer.error is None
    check_offloaded(gpu, host, before, pages, blocks)
