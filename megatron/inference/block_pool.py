"""The KV-cache block allocator of the inference engine: reference-counted blocks and the prefix cache.

Every block is in exactly one state: free (never used, or evicted), in use (reference count > 0: one per request
holding it) or cached (reference count 0, still holding the K/V of a full prompt block that a later request with the
same prefix may take back; evicted least recently released first when free blocks run out). A full block of prompt
tokens is registered under the hash of the whole prefix up to its end (a SHA-256 chain), so two requests share a
block only when their prompts agree on every token before and in it. Shared blocks are never written again: only
full, immutable prompt blocks are shared, so no copy-on-write is needed.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Sequence


def prefix_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of each full block of `tokens` (entry i covers tokens 0 .. (i + 1) * block_size - 1)."""
    out, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = ",".join(str(int(t)) for t in tokens[start:start + block_size]).encode()
        parent = hashlib.sha256(parent + b"|" + block).digest()
        out.append(parent)
    return out


class BlockPool:
    """`num_blocks` block ids with reference counts and the prefix cache (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first

    def available(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached ones)."""
        return len(self.free) + len(self.evictable)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, each with reference count 1; free ones first, then the oldest evictable cached ones."""
        if count > self.available():
            raise RuntimeError(f"block pool: {count} blocks asked, {self.available()} available")
        blocks = []
        for _ in range(count):
            if self.free:
                block = self.free.popleft()
            else:
                block, _ = self.evictable.popitem(last=False)
                del self.by_hash[self.hash_of.pop(block)]
            self.refcount[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` present (not yet acquired)."""
        blocks = []
        for h in hashes:
            block = self.by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take one more reference to each cached block of `blocks` (from `lookup`)."""
        for block in blocks:
            self.evictable.pop(block, None)
            self.refcount[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of `blocks`; a block nobody holds becomes cached (registered) or free."""
        for block in blocks:
            if self.refcount[block] <= 0:
                raise RuntimeError(f"block pool: block {block} released more often than taken")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if block in self.hash_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)

    def register(self, block: int, digest: bytes) -> None:
        """Record that in-use `block` holds the full prompt block `digest` (a no-op if another block already does)."""
        if digest not in self.by_hash and block not in self.hash_of:
            self.by_hash[digest] = block
            self.hash_of[block] = digest

    def cached_count(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self.hash_of)

    def check(self) -> None:
        """Assert the invariants: each block free, in use or evictable-cached exactly once; the hash maps agree."""
        free = set(self.free)
        assert len(free) == len(self.free), "a block is free twice"
        evictable = set(self.evictable)
        in_use = {b for b in range(self.num_blocks) if self.refcount[b] > 0}
        assert not (free & evictable) and not (free & in_use) and not (evictable & in_use), "a block in two states"
        assert free | evictable | in_use == set(range(self.num_blocks)), "a block leaked"
        assert all(self.refcount[b] == 0 for b in free | evictable), "a free block is referenced"
        assert evictable <= set(self.hash_of), "an evictable block is not cached"
        assert not (free & set(self.hash_of)), "a free block is still cached"
        assert {self.by_hash[h]: h for h in self.by_hash} == self.hash_of, "hash maps disagree"
