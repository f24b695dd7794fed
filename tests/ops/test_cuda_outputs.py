"""ops._cuda.kernel_outputs: buffers a kernel writes in full skip torch's deterministic-mode fill, and the setting
comes back whatever happens inside."""
import pytest
import torch

from ops._cuda import kernel_outputs


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_fill_is_skipped_inside_and_restored_after(deterministic):
    det = torch.utils.deterministic
    assert det.fill_uninitialized_memory
    assert torch.isnan(torch.empty(257)).all()   # what deterministic mode does to every empty tensor
    with kernel_outputs():
        assert not det.fill_uninitialized_memory
    assert det.fill_uninitialized_memory
    assert torch.isnan(torch.empty(257)).all()


def test_the_setting_comes_back_after_an_error(deterministic):
    det = torch.utils.deterministic
    with pytest.raises(ValueError, match="boom"):
        with kernel_outputs():
            raise ValueError("boom")
    assert det.fill_uninitialized_memory
    det.fill_uninitialized_memory = False   # a user's own choice is kept too
    try:
        with kernel_outputs():
            pass
        assert not det.fill_uninitialized_memory
    finally:
        det.fill_uninitialized_memory = True
