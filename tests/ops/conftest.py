"""Fixtures of the ops tests: a fresh seed per test (printed, so a failure can be replayed with
``PACKLOADER_TEST_SEED=<seed>``) and the backend override restored after every test."""
from __future__ import annotations

import os
import random

import pytest
import torch


@pytest.fixture
def seed():
    value = int(os.environ.get("PACKLOADER_TEST_SEED", random.randrange(2**31)))
    print(f"seed={value} (replay with PACKLOADER_TEST_SEED={value})")
    torch.manual_seed(value)
    random.seed(value)
    return value


@pytest.fixture(autouse=True)
def _restore_backends():
    """No test leaks a set_backend() choice into the next one."""
    from ops import backends

    saved = backends.get_backend()
    yield
    backends.set_backend(saved)


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    """The ops tests run thousands of tiny kernels: intra-op threads only add overhead (10x on a busy
    2-core machine), so run them on one thread and restore the setting afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def cuda():
    """The CUDA device for GPU tests that compare in float32: TF32 matmuls off (fp32 means fp32), restored after."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
