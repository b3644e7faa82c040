"""Tensors on huge pages (kernels/huge_pages.py): what the packed weights and the KV cache are allocated with. They
hold what plain tensors hold, they outlive the arena they were carved from, the memory really is on 2 MiB pages
where the system grants them (read back from /proc/self/smaps), and DSPARK_HUGE_PAGES=0 gives plain tensors."""

from __future__ import annotations

import gc

import pytest
import torch

from dspark.kernels import huge_pages, native
from dspark.models.target.kv_cache import KVCachePool

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this system")


def _anon_huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds `t`'s first byte (/proc/self/smaps)."""
    addr, inside, kb = t.data_ptr(), False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                kb = int(line.split()[1])
    return kb


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_tensors_hold_what_plain_ones_hold_and_zeros_are_zero(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    ref = (torch.randn(300, 577, generator=gen) * 50).to(dtype)
    t = huge_pages.empty(ref.shape, dtype)
    assert t.shape == ref.shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    t.copy_(ref)
    assert torch.equal(t, ref)
    z = huge_pages.zeros((3, 1000), dtype)
    assert z.shape == (3, 1000) and not z.any()
    assert huge_pages.empty((0, 5), dtype).shape == (0, 5)


def test_carved_tensors_do_not_overlap_and_outlive_their_arena() -> None:
    a = huge_pages.empty((1000,), torch.float32).fill_(1.0)
    b = huge_pages.empty((3,), torch.float64).fill_(2.0)
    big = huge_pages.empty((huge_pages.ARENA_BYTES,), torch.uint8).fill_(3)  # its own mapping
    if huge_pages.available():  # carved 4 KiB apart, the big one on a 2 MiB boundary
        assert b.data_ptr() - a.data_ptr() == 4096
        assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    huge_pages._arena[:] = [None, 0, 0]  # the arena forgotten: its tensors keep its mapping alive
    gc.collect()
    c = huge_pages.empty((1000,), torch.float32).fill_(4.0)
    assert a.eq(1.0).all() and b.eq(2.0).all() and big.eq(3).all() and c.eq(4.0).all()


@needs_thp
def test_the_memory_is_on_huge_pages() -> None:
    t = huge_pages.zeros((16 << 20,), torch.uint8)  # 16 MiB, touched by zero_()
    assert _anon_huge_kb(t) >= 2048, "no 2 MiB page behind a 16 MiB tensor"


@needs_thp
def test_packed_weights_and_the_kv_cache_are_allocated_on_huge_pages() -> None:
    kv = KVCachePool(2, 3, 64, 8, 2048, torch.bfloat16, torch.device("cpu"))  # 6 MiB a tensor
    assert all(_anon_huge_kb(t) >= 2048 for t in kv.k + kv.v)
    assert not any(t.any() for t in kv.k + kv.v)  # zeros: masked keys enter P@V
    if native.is_available():
        w = torch.randn(3072, 576).to(torch.bfloat16)
        assert _anon_huge_kb(native.amx_pack(w)) >= 2048
        f = torch.randn(1024, 576)
        assert _anon_huge_kb(native.pack(f)) >= 2048


def test_switched_off_gives_plain_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.available()
    t = huge_pages.zeros((16 << 20,), torch.uint8)
    assert not t.any()
    if "[madvise]" in huge_pages.THP_MODE.read_text():  # (under `always` every large mapping gets them)
        assert _anon_huge_kb(t) == 0
