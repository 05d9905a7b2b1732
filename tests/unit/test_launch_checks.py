"""`prism serve` validates every service's section before it starts any: a bad value is one
clear error naming the key, not a child failing and restarting until the start-up timeout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.config import REPO_ROOT, ConfigError
from gateway.config import GatewayConfig
from prism.demo_model import SHAPES_MODEL
from prism.launch import check_service_configs, service_children


def children():
    config = GatewayConfig(models={"chat": {"encoder_addresses": ["ipc:///tmp/e.sock"], "engine_addresses": ["ipc:///tmp/g.sock"],
                                            "checkpoint": str(SHAPES_MODEL)}})
    return service_children(config, None, str(SHAPES_MODEL))


def test_every_child_s_section_is_checked_with_its_own_environment(monkeypatch):
    check_service_configs(children())  # the defaults pass
    monkeypatch.setenv("PRISM_ENGINE__MAX_MODEL_LEN", "abc")
    with pytest.raises(ConfigError, match=r"engine\.max_model_len"):
        check_service_configs(children())
    monkeypatch.delenv("PRISM_ENGINE__MAX_MODEL_LEN")
    monkeypatch.setenv("PRISM_ENCODER__MAX_BATCH_IMAGES", "0")
    with pytest.raises(ConfigError, match=r"encoder\.max_batch_images"):
        check_service_configs(children())


def test_prism_serve_exits_at_once_naming_the_bad_key():
    env = {**os.environ, "PRISM_ENGINE__MAX_MODEL_LEN": "abc"}
    done = subprocess.run([sys.executable, "-m", "prism", "serve", "--config", "configs/cpu-demo.yaml"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "prism serve: invalid config" in done.stderr and "engine.max_model_len" in done.stderr, done.stderr[-2000:]
    assert "started" not in done.stderr  # no child was started
