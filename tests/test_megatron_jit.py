"""Megatron-Core imported after the package: its ``jit_fuser`` is Megatron's no-op decorator,
the functions it decorates are not wrapped by TorchDynamo, and neither TorchDynamo nor Inductor
is loaded; imported before the package, Megatron is left as it was (each case in a fresh
interpreter). The fusions that would call those functions are off in the model's config."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from attnres_dist.config import load_config
from attnres_dist.model.megatron_config import transformer_config

PROBE = """
import json, sys
{first}
import megatron.core.activations as act
import megatron.core.jit as jit
print(json.dumps({{
    "noop": jit.jit_fuser is jit.noop_decorator,
    "plain": not hasattr(act.squared_relu, "_torchdynamo_orig_callable"),
    "dynamo": "torch._dynamo" in sys.modules,
    "inductor": "torch._inductor.compile_fx" in sys.modules,
}}))
"""


def probe(first: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", PROBE.format(first=first)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_megatron_after_the_package_compiles_nothing_at_import():
    found = probe("import attnres_dist")
    assert found == {"noop": True, "plain": True, "dynamo": False, "inductor": False}


def test_megatron_before_the_package_is_left_alone():
    found = probe("import megatron.core\nimport attnres_dist")
    assert found["noop"] is False and found["plain"] is False and found["inductor"] is True


def test_every_fusion_that_would_call_jit_fuser_functions_is_off():
    for on_gpu in (False, True):
        cfg = transformer_config(load_config(None, []).model, on_gpu=on_gpu)
        assert not (cfg.bias_activation_fusion or cfg.bias_dropout_fusion)
        assert not (cfg.apply_rope_fusion or cfg.qk_l2_norm or cfg.num_moe_experts)
        assert cfg.activation_func is torch.nn.functional.silu and cfg.gated_linear_unit
