"""The KV-cache block allocator (megatron/inference/block_pool.py): under randomized admit / finish / cancel
sequences with prefix sharing no block leaks, none is used twice, and shared blocks hold the same prefix."""
from __future__ import annotations

import random

import pytest

from megatron.inference import BlockPool, prefix_hashes


@pytest.mark.parametrize("seed", range(6))
def test_random_admit_finish_cancel_keeps_the_invariants(seed):
    rng = random.Random(seed)
    pool, bs = BlockPool(rng.randint(4, 24)), 4
    prefixes = [[rng.randrange(5) for _ in range(8)] for _ in range(3)]
    held: dict[int, tuple[list[int], list[bytes]]] = {}  # request -> (blocks, prompt block hashes)
    owner_of_content: dict[bytes, set[int]] = {}
    for rid in range(400):
        if held and rng.random() < 0.45:  # finish or cancel a random request (the pool cannot tell them apart)
            blocks, hashes = held.pop(rng.choice(sorted(held)))
            for block, digest in zip(blocks, hashes):
                pool.register(block, digest)  # its prompt blocks were computed
            pool.release(blocks)
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(0, 9))]
            hashes = prefix_hashes(prompt, bs)
            shared = pool.lookup(hashes[: (len(prompt) - 1) // bs])
            total = -(-(len(prompt) + rng.randint(1, 6)) // bs)
            idle = sum(1 for b in shared if pool.refcount[b] == 0)
            if total - len(shared) > pool.available() - idle:
                continue  # would be queued
            pool.acquire(shared)
            blocks = shared + pool.allocate(total - len(shared))
            assert len(set(blocks)) == len(blocks)
            for other, _ in held.values():  # a non-shared block is nobody else's
                assert not (set(blocks[len(shared):]) & set(other))
            for block, digest in zip(shared, hashes):
                owner_of_content.setdefault(digest, set()).add(block)
                assert pool.hash_of[block] == digest  # a shared block holds exactly this prefix
            held[rid] = (blocks, hashes[: len(prompt) // bs])
        pool.check()
        counts = [0] * pool.num_blocks
        for blocks, _ in held.values():
            for b in blocks:
                counts[b] += 1
        assert counts == pool.refcount
    for blocks, _ in held.values():
        pool.release(blocks)
    pool.check()
    assert pool.available() == pool.num_blocks


def test_releasing_twice_and_over_allocating_are_errors():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    with pytest.raises(RuntimeError, match="2 available|0 available"):
        pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(blocks[:1])


def test_prefix_hashes_cover_the_whole_prefix():
    a, b = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), prefix_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert prefix_hashes([1, 2, 3], 4) == [] and prefix_hashes([1, 2, 3, 4, 5], 4) == a[:1]
