import os

import pytest
import torch

os.environ.setdefault("LAB_PROFILE", "smoke")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0
