"""A model's encoders and engines must run one checkpoint: the engine takes the encoders' tokens as
its own tower's, and another checkpoint's of the same width are taken without an error, to answer
wrongly (an encoder on the shapes model beside an engine on the random one answered "purple" about
a blue circle). Each service reports its checkpoint's vision weights in its handshake
(common/checkpoint.py), and the gateway will not serve a model whose two disagree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common.config import REPO_ROOT
from prism.demo_model import SHAPES_MODEL
from testing.stack import free_port
from tests.integration.encoder_socket import encoder_process
from tests.waiting import wait_until


def test_a_gateway_refuses_a_model_whose_encoders_and_engines_run_different_checkpoints(stack, tmp_path):
    log = tmp_path / "gateway.log"
    with encoder_process(tmp_path, model=SHAPES_MODEL) as other:  # the stack's engine runs the random demo model
        env = dict(os.environ, PRISM_GATEWAY__PORT=str(free_port()), PRISM_GATEWAY__ENCODER_ADDRESSES=json.dumps([other.address]),
                   PRISM_GATEWAY__ENGINE_ADDRESSES=json.dumps(stack.engine_addresses), PRISM_LOG_FORMAT="text")
        with open(log, "wb") as out:
            gateway = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:  # it gives up, or (wrongly) serves
            wait_until(lambda: gateway.poll() is not None or "Prism ready" in log.read_text(), 240, "the gateway's start ended")
        finally:
            gateway.terminate()
            gateway.wait(30)
    output = log.read_text()
    assert "Prism ready" not in output, output[-3000:]
    assert "were started on different checkpoints" in output and "prism-shapes" in output, output[-3000:]
