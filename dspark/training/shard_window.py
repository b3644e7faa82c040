"""A sliding window over cache shards: training on a cache larger than memory.

The target cache of a few million tokens is tens of GB; holding it in RAM is not possible on this kind of
machine. The window keeps `resident` shards loaded and draws each batch from them; every
`steps_per_shard` steps the oldest shard leaves and the next one of a per-epoch random order enters.
Which shards are resident is a function of the step alone, so a resumed run sees the same window.
"""

from __future__ import annotations

import bisect
import random
from pathlib import Path

from safetensors import safe_open

from dspark.training.target_cache import CachedShard


class ShardWindowPool:
    def __init__(self, paths: list[Path], resident: int = 64, steps_per_shard: int = 4, seed: int = 0) -> None:
        if not paths:
            raise FileNotFoundError("no cache shards")
        self.paths = list(paths)
        self.resident = min(resident, len(self.paths))
        self.steps_per_shard = steps_per_shard
        self.seed = seed
        self.sizes = []
        for p in self.paths:
            with safe_open(str(p), framework="pt") as f:
                self.sizes.append(f.get_slice("prompt_lens").get_shape()[0])
        self.starts = [0]
        for n in self.sizes:
            self.starts.append(self.starts[-1] + n)
        self._loaded: dict[int, CachedShard] = {}
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.paths)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order, **{e: o for e, o in self._orders.items() if e == epoch - 1}}
        return self._orders[epoch]

    def window(self, step: int) -> list[int]:
        """The shards resident at `step`: positions w .. w+resident-1 of the epochs' orders, concatenated."""
        w = step // self.steps_per_shard
        n = len(self.paths)
        return [self._order((w + i) // n)[(w + i) % n] for i in range(self.resident)]

    def sample(self, rng: random.Random, n: int, step: int) -> list[int]:
        shards = self.window(step)
        for s in list(self._loaded):
            if s not in shards:
                del self._loaded[s]
        for s in shards:
            if s not in self._loaded:
                self._loaded[s] = CachedShard.load(self.paths[s])
        pairs = [(s, i) for s in shards for i in range(self.sizes[s])]
        return [self.starts[s] + i for s, i in rng.sample(pairs, min(n, len(pairs)))]

    def get(self, idx: int) -> tuple:
        s = bisect.bisect_right(self.starts, idx) - 1
        return self._loaded[s].sequence(idx - self.starts[s])
