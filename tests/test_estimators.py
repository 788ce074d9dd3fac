"""Group advantages and the scheme registry."""

import pytest
import torch

from grail_exp.advantages import SCHEMES, build_scheme
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


def test_registry_has_grpo_and_grpo_weights_are_ones():
    from omegaconf import OmegaConf

    from grail_exp.advantages import SchemeBatch

    assert "grpo" in SCHEMES
    scheme = build_scheme(OmegaConf.create({"name": "grpo"}))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = scheme.weights(None, SchemeBatch(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), torch.zeros(2, 5),
                                           2, torch.zeros(2, 3, dtype=torch.long), mask, torch.zeros(2), torch.zeros(2)))
    assert out.weights.shape == (2, 3) and torch.all(out.weights == 1)


def test_unknown_scheme():
    from omegaconf import OmegaConf

    with pytest.raises(KeyError, match="grpo"):
        build_scheme(OmegaConf.create({"name": "nope"}))
