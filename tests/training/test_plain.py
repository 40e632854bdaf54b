"""train_seeds: one plain run of any nn.Module per seed, stacked (book: "symlib on your own network")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from symlib import training as T


class _BNNet(nn.Module):
    """conv + BatchNorm + ReLU, global average pool, linear: a network with buffers to carry."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(20, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (20,), generator=g)


RECIPE = T.Recipe(epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3, crop_padding=1)


def _make():
    return _BNNet().double()


def test_train_seeds_is_one_plain_run_per_seed():
    """Entry i of the stack is train_plain on seed i's initialisation, buffers included; the runs do not
    depend on the number of worker threads (each run is computed on one thread)."""
    x, y = _data()
    seeds = [3, 11, 7]
    one = T.train_seeds(_make, seeds, x, y, RECIPE, workers=1)
    two = T.train_seeds(_make, seeds, x, y, RECIPE, workers=2)
    assert set(one) == set(_BNNet().state_dict())
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as train_seeds runs each seed: one intra-op thread
    try:
        refs = [T.train_plain(T.init_model(_make, s), s, x, y, RECIPE).state_dict() for s in seeds]
    finally:
        torch.set_num_threads(before)
    for i, ref in enumerate(refs):
        for k, v in ref.items():
            assert torch.equal(one[k][i], v), k
            assert torch.equal(two[k][i], v), k
    assert int(one["bn.num_batches_tracked"][0]) == 2 * 3  # 2 epochs of 3 batches
    # negative control: the seeds give different runs
    assert not torch.allclose(one["conv.weight"][0], one["conv.weight"][1])


def test_train_seeds_float32_does_not_depend_on_workers():
    """In float32 too (where more intra-op threads would reduce convolutions in another order), and
    repeatedly: runs starting together on several threads must not share the initialisation's random
    numbers (PyTorch's initialisers draw from the global generator)."""
    x, y = _data()
    x = x.float()
    runs = [T.train_seeds(_BNNet, [0, 1, 2, 3], x, y, RECIPE, workers=w) for w in (1, 2, 4, 4, 4)]
    for other in runs[1:]:
        for k, v in runs[0].items():
            assert torch.equal(other[k], v), k


def test_train_seeds_leaves_the_thread_count():
    x, y = _data()
    before = torch.get_num_threads()
    T.train_seeds(_make, [0, 1], x, y, RECIPE, epochs=1, workers=2)
    assert torch.get_num_threads() == before


def test_train_seeds_refuses_no_or_repeated_seeds():
    x, y = _data()
    with pytest.raises(ValueError, match="at least one seed"):
        T.train_seeds(_make, [], x, y, RECIPE)
    with pytest.raises(ValueError, match="distinct"):
        T.train_seeds(_make, [1, 1], x, y, RECIPE)
