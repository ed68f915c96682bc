"""feed_tokens puts the previous step's sampled tokens (still on the device) into the next step's
ids; warm_feed_tokens takes its reordering path once at startup without changing the ids."""

import numpy as np
import pytest
import torch
from conftest import DEVICE

from arcserve.engine.step_graphs import feed_tokens, warm_feed_tokens


def _ids(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(1000, 2000, (n,), dtype=dtype, device=DEVICE)


@pytest.fixture
def index_copies(monkeypatch) -> list:
    """The index dtypes of every index_copy_ (feed_tokens' reordering path) made meanwhile."""
    seen, orig = [], torch.Tensor.index_copy_

    def spy(self, dim, index, source):
        seen.append(index.dtype)
        return orig(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", spy)
    return seen


def test_a_decode_batch_in_the_previous_order_is_one_slice_copy(index_copies):
    ids, last = _ids(6, torch.int64), _ids(4, torch.int64)
    want = ids.clone()
    want[:4] = last
    feed_tokens(ids, last, np.arange(4), np.arange(4))
    assert torch.equal(ids, want) and index_copies == []


@pytest.mark.parametrize("device_indices", [False, True])
def test_reordered_tokens_land_where_the_indices_say(device_indices):
    """Host indices (eager steps, int64 ids) and device indices (graph steps, an int32 buffer)."""
    dtype = torch.int32 if device_indices else torch.int64
    ids, last = _ids(8, dtype), _ids(5, torch.int64)
    dst_h, src_h = np.array([7, 2, 5]), np.array([4, 0, 3])
    want = ids.clone()
    want[dst_h] = last[src_h].to(dtype)
    idx = {}
    if device_indices:
        idx = {"dst": torch.tensor(dst_h, dtype=torch.int32, device=DEVICE),
               "src": torch.tensor(src_h, dtype=torch.int32, device=DEVICE)}  # fmt: skip
    feed_tokens(ids, last, dst_h, src_h, **idx)
    assert torch.equal(ids, want)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_warming_the_reordering_path_leaves_the_ids_as_they_were(dtype, index_copies):
    """It takes the index path (one index_copy_, int64 indices as feed_tokens makes them) over
    either layout, and the ids come out as they went in."""
    ids = _ids(5, dtype)
    want = ids.clone()
    order = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    warm_feed_tokens(ids, *((order, order) if dtype == torch.int32 else ()))
    assert torch.equal(ids, want) and index_copies == [torch.int64]
    one = _ids(1, dtype)
    kept = one.clone()
    warm_feed_tokens(one)  # too short to reorder: nothing happens, nothing fails
    assert torch.equal(one, kept) and index_copies == [torch.int64]
