"""`build_optimizer`: fused on CUDA where the optimizer has a fused implementation, the default elsewhere."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from chattune.train.optimizer import build_optimizer


def _config(**extra):
    return OmegaConf.create({"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3, **extra})


def test_fused_on_cuda_unless_the_config_says_otherwise():
    params = [torch.nn.Parameter(torch.zeros(3))]  # fused AdamW also runs on CPU tensors, so this runs anywhere
    assert build_optimizer(_config(), params, torch.device("cuda")).defaults["fused"] is True
    assert not build_optimizer(_config(), params, torch.device("cpu")).defaults["fused"]
    assert not build_optimizer(_config(fused=False), params, torch.device("cuda")).defaults["fused"]
    assert not build_optimizer(_config(foreach=True), params, torch.device("cuda")).defaults["fused"]  # not both
    without_fused = OmegaConf.create({"_target_": "torch.optim.LBFGS", "_partial_": True, "lr": 1e-3})
    assert "fused" not in build_optimizer(without_fused, params, torch.device("cuda")).defaults  # not passed
