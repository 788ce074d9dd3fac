"""Group advantages: the rewards normalised within each group of rollouts (scale_rewards none / group / batch)."""

import pytest
import torch

from grail_exp.estimators.group import group_advantages

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # two groups of G = 4


def test_scale_none_is_dr_grpo():
    a, zero = group_advantages(R, 4, "none")
    assert torch.allclose(a, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    assert zero.tolist() == [False] * 4 + [True] * 4


def test_scale_group_divides_by_unbiased_group_std():
    a, _ = group_advantages(R, 4, "group")
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, = 0.5774
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4))
    assert torch.all(a[4:] == 0)  # zero-variance group: 0 / (0 + 1e-4)


def test_scale_batch_divides_by_batch_std():
    a, _ = group_advantages(R, 4, "batch")
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (R.std() + 1e-4))


def test_bad_inputs():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(R, 3, "none")
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(R, 4, "nope")
