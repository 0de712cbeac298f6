"""``runtime.cuda_graphs`` selection: refused without a GPU or compiled layers, taken on a GPU
when asked for or once the GPU check has run it. Availability is simulated (the ``machine``
fixture, ``tests/conftest.py``); the graphs themselves replay in ``tests/test_cuda_graphs.py``
on a GPU."""

from __future__ import annotations

import pytest

from attnres_dist.config import RuntimeConfig, load_config
from attnres_dist.errors import ConfigError
from attnres_dist.runtime import Choice, select_runtime


def test_cuda_graphs_on_a_cpu_is_a_one_line_config_error_naming_the_field(machine):
    machine(cuda=False)
    with pytest.raises(ConfigError) as info:
        select_runtime(RuntimeConfig(compile="layer", cuda_graphs="on"))
    message = str(info.value)
    assert info.value.where == "runtime.cuda_graphs" and "\n" not in message
    assert message == (
        "runtime.cuda_graphs: 'on' needs a CUDA device (no CUDA device visible); use auto or off"
    )
    assert select_runtime(RuntimeConfig()).cuda_graphs == Choice("off", "no GPU")


def test_cuda_graphs_need_compiled_layers_in_the_config():
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.yaml", ["runtime.cuda_graphs=on"])
    assert info.value.where == "runtime.cuda_graphs"
    assert "runtime.compile=layer" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.yaml", ["runtime.cuda_graphs=maybe"])
    assert info.value.where == "runtime.cuda_graphs"
    # YAML's bare on reads as true; the section turns it back into the word
    cfg = load_config("configs/tiny.yaml", ["runtime.compile=layer", "runtime.cuda_graphs=on"])
    assert cfg.runtime.cuda_graphs == "on"
    graphs = ["runtime.compile=layer", "runtime.cuda_graphs=on"]
    with pytest.raises(ConfigError) as info:  # CUDA graph trees are inductor's
        load_config("configs/tiny.yaml", [*graphs, "runtime.compile_backend=aot_eager"])
    assert info.value.where == "runtime.cuda_graphs"
    assert "compile_backend=inductor" in str(info.value)


def test_cuda_graphs_on_a_gpu_asked_for_or_after_the_check(machine, monkeypatch):
    from attnres_dist.runtime import gpu_checked

    machine(cuda=True, bf16=True)
    asked = select_runtime(RuntimeConfig(compile="layer", cuda_graphs="on"))
    assert asked.graphed and asked.compiled
    assert "cuda_graphs=on (set in config; CUDA graph trees" in asked.describe()
    auto = select_runtime(RuntimeConfig(compile="layer"))
    assert not auto.graphed and "not yet run by the GPU check" in auto.cuda_graphs.reason
    note = gpu_checked.RUN_BY_GPU_CHECK["cuda_graphs=on"][1]
    monkeypatch.setitem(gpu_checked.RUN_BY_GPU_CHECK, "cuda_graphs=on", (True, note))
    assert select_runtime(RuntimeConfig(compile="layer")).graphed
    assert not select_runtime(RuntimeConfig()).graphed  # compile auto is off on a GPU
    with pytest.raises(ConfigError, match=r"^runtime\.cuda_graphs: 'on' replays compiled"):
        select_runtime(RuntimeConfig(cuda_graphs="on"))  # built without the config's rules
    off = select_runtime(RuntimeConfig(compile="layer", cuda_graphs="off"))
    assert off.cuda_graphs == Choice("off", "set in config")
