"""Unit tests are many tiny tensor ops: one intra-op thread is faster than thread fan-out on small CPUs."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_thread_torch():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
