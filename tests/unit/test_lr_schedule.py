import pytest

from learner.lr_schedule import lr_at


def test_linear_goes_from_base_to_floor():
    assert lr_at(1, 100, 1e-3, "linear", 0.1) == pytest.approx(1e-3)
    assert lr_at(100, 100, 1e-3, "linear", 0.1) == pytest.approx(1e-4)
    assert lr_at(1, 100, 1e-3, "linear", 0.1) > lr_at(50, 100, 1e-3, "linear", 0.1) > lr_at(100, 100, 1e-3, "linear", 0.1)


def test_constant_and_unknown():
    assert lr_at(77, 100, 5e-4, "constant", 0.1) == 5e-4
    with pytest.raises(ValueError):
        lr_at(1, 10, 1e-3, "cosine-ish", 0.1)
