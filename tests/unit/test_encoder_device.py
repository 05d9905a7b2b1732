"""The encoder's share of its GPU (`encoder.gpu_memory_fraction`) is set on the GPU it runs on,
through torch's own call (its CUDA entry points stubbed here: no GPU on this machine)."""

from __future__ import annotations

import pytest
import torch

from vision_encoder.service import cap_device_memory


@pytest.fixture
def set_fractions(monkeypatch) -> list:
    done: list = []
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_setMemoryFraction", lambda fraction, index: done.append((fraction, index)), raising=False)
    return done


@pytest.mark.parametrize("device,index", [("cuda", 0), ("cuda:0", 0), ("cuda:1", 1)])
def test_the_share_is_set_on_the_encoder_s_own_gpu(set_fractions, device, index):
    """`device: cuda`, as the one-box GPU profiles have it, carries no index: torch refuses such a device."""
    cap_device_memory(0.12, device)
    assert set_fractions == [(0.12, index)]
