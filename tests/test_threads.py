"""symlib.threads: the intra-op thread count inside and after a block."""

import pytest
import torch

from symlib import threads


def test_single_sets_one_thread_and_restores_it_even_after_an_error():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with threads.single():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"), threads.single():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
