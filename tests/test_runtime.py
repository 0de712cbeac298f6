"""Fast-path selection (attnres_dist.runtime): what is chosen, why, and what is refused.

Availability is simulated by replacing the probe functions in ``attnres_dist.runtime.probes``
(the ``machine`` fixture, ``tests/conftest.py``);
nothing pretends to be Transformer Engine or apex. What runs for real on this CPU machine: the
config section and its validation, the routing from a choice to Megatron's layer spec and to
the optimizer class, and the refusal of a training run that asks for TE, before any process
group starts. bf16 is DeepSpeed's bf16 engine, which runs on CPU too (tests/test_precision.py).
"""

from __future__ import annotations

import types

import pytest
import torch

from attnres_dist.config import RuntimeConfig, config_from_dict, load_config
from attnres_dist.errors import ConfigError
from attnres_dist.model import layer_specs
from attnres_dist.optim import adam_class
from attnres_dist.runtime import Choice, RuntimeChoice, select_runtime


def values(choice: RuntimeChoice) -> tuple[str, ...]:
    return (
        choice.device.value,
        choice.layer_spec.value,
        choice.norm.value,
        choice.optimizer.value,
        choice.dtype.value,
    )


# ------------------------------------------------------------------------------------- auto


def test_cpu_machine_takes_the_local_spec_and_torch_ops_without_probing_gpu_libraries(machine):
    called = machine(cuda=False)
    choice = select_runtime(RuntimeConfig())
    assert values(choice) == ("cpu", "local", "torch", "torch", "fp32")
    # no Transformer Engine or apex import attempted without a GPU; the C kernels and the C
    # library (for the allocator policy) are asked
    assert called == ["cuda", "cpu_kernels", "glibc_malloc"]
    assert choice.norm.reason == "the C kernels cannot be built here (no C compiler)"
    line = choice.describe()
    assert "\n" not in line and line.startswith("runtime: ")
    assert "device=cpu (no CUDA device visible)" in line
    assert "layer_spec=local (no GPU)" in line and "dtype=fp32 (no GPU)" in line


def test_gpu_auto_leaves_out_what_the_gpu_check_has_not_run(machine):
    """TE's spec, apex's norm and Adam import here, yet ``auto`` takes none of them: no GPU
    check has run them (runtime/gpu_checked.py). It does not even import them, and the line
    says why and how to ask for each."""
    called = machine(cuda=True, bf16=True, transformer_engine=True, apex_norm=True, apex_adam=True)
    choice = select_runtime(RuntimeConfig())
    assert values(choice) == ("cuda", "local", "torch", "torch", "bf16")
    assert not {"transformer_engine", "apex_norm", "apex_adam"} & set(called)
    line = choice.describe()
    assert "layer_spec=local (auto: layer_spec=te not yet run by the GPU check (" in line
    assert "runtime.layer_spec=te takes it" in line
    assert "norm=torch (auto: fused_norm=apex not yet run by the GPU check (" in line
    assert "optimizer=torch (auto: fused_optimizer=apex not yet run by the GPU check (" in line
    assert "runtime.fused_optimizer=on takes it" in line
    assert "cuda_graphs=off (auto: cuda_graphs=on not yet run by the GPU check (" in line
    assert choice.core_attention.value == "sdpa"


@pytest.fixture
def gpu_checked(monkeypatch):
    """The table as it reads once a GPU check has run every fast path (one flip each)."""
    from attnres_dist.runtime import gpu_checked

    for path, (_, note) in list(gpu_checked.RUN_BY_GPU_CHECK.items()):
        monkeypatch.setitem(gpu_checked.RUN_BY_GPU_CHECK, path, (True, note))


def test_gpu_with_te_and_apex_takes_every_fast_path_the_check_has_run(machine, gpu_checked):
    machine(cuda=True, bf16=True, transformer_engine=True, apex_norm=True, apex_adam=True)
    choice = select_runtime(RuntimeConfig())
    assert values(choice) == ("cuda", "te", "apex", "apex", "bf16")
    line = choice.describe()
    assert "device=cuda (NVIDIA H100 80GB HBM3)" in line
    assert "layer_spec=te (transformer_engine 2.10.0)" in line
    assert "optimizer=apex (apex FusedAdam)" in line
    assert "dtype=bf16 (GPU compute capability 9.0; DeepSpeed bf16 engine, fp32 master " in line
    # under the TE spec the layers' norms are TE's; apex is left with the final norm
    assert "final norm only" in choice.norm.reason
    # CUDA graphs replay compiled layers: with compile off (auto on a GPU), auto leaves them
    assert "cuda_graphs=off (auto: CUDA graphs replay compiled layers" in line


def test_gpu_without_te_or_apex_says_which_import_failed(machine, gpu_checked):
    machine(cuda=True, bf16=True)
    choice = select_runtime(RuntimeConfig())
    assert values(choice) == ("cuda", "local", "torch", "torch", "bf16")
    assert "No module named 'transformer_engine'" in choice.layer_spec.reason
    assert "No module named 'apex'" in choice.norm.reason
    assert "No module named 'apex'" in choice.optimizer.reason


def test_gpu_without_bf16_support_stays_fp32(machine, gpu_checked):
    machine(cuda=True, transformer_engine=True, apex_norm=True, apex_adam=True)
    choice = select_runtime(RuntimeConfig())
    assert values(choice) == ("cuda", "te", "apex", "apex", "fp32")
    assert "compute capability 7.0" in choice.dtype.reason


def test_apex_norm_with_local_spec_applies_to_every_norm(machine, gpu_checked):
    machine(cuda=True, bf16=True, apex_norm=True)
    choice = select_runtime(RuntimeConfig())
    assert choice.norm.value == "apex" and "final norm only" not in choice.norm.reason


# --------------------------------------------------------------------------------- explicit


def test_explicit_plain_paths_override_auto_without_probing(machine):
    called = machine(cuda=True, bf16=True, transformer_engine=True, apex_norm=True, apex_adam=True)
    requested = RuntimeConfig(
        layer_spec="local", fused_norm="off", fused_optimizer="off", dtype="fp32"
    )
    choice = select_runtime(requested)
    assert values(choice) == ("cuda", "local", "torch", "torch", "fp32")
    assert all(c.reason == "set in config" for c in values_choices(choice)[1:])
    assert called == ["cuda"]


def values_choices(choice: RuntimeChoice) -> list[Choice]:
    return [choice.device, choice.layer_spec, choice.norm, choice.optimizer, choice.dtype]


def test_explicit_fast_paths_are_taken_when_available(machine):
    machine(cuda=True, bf16=True, transformer_engine=True, apex_norm=True, apex_adam=True)
    requested = RuntimeConfig(layer_spec="te", fused_norm="on", fused_optimizer="on", dtype="bf16")
    choice = select_runtime(requested)
    assert values(choice) == ("cuda", "te", "apex", "apex", "bf16")
    assert choice.layer_spec.reason == "set in config; transformer_engine 2.10.0"


@pytest.mark.parametrize(
    "field, value, available, expected",
    [
        ("layer_spec", "te", {"cuda": True}, "No module named 'transformer_engine'"),
        ("fused_norm", "on", {"cuda": True}, "apex FusedRMSNorm not importable"),
        ("fused_optimizer", "on", {"cuda": True}, "apex FusedAdam not importable"),
        ("dtype", "bf16", {"cuda": True}, "has no bf16 support"),
        ("layer_spec", "te", {}, "needs a CUDA device (no CUDA device visible)"),
        ("fused_norm", "on", {}, "on CPU but the C kernels cannot be built here"),
    ],
)
def test_requesting_a_missing_fast_path_is_a_one_line_config_error(
    machine, field, value, available, expected
):
    machine(**available)
    with pytest.raises(ConfigError) as info:
        select_runtime(RuntimeConfig(**{field: value}))
    message = str(info.value)
    assert info.value.where == f"runtime.{field}"
    assert message.startswith(f"runtime.{field}: {value!r} ")
    assert expected in message and "use auto or" in message
    assert "\n" not in message


def test_cpu_machine_takes_the_fused_c_norm_where_the_kernels_build(machine):
    called = machine(cpu_kernels=True)
    choice = select_runtime(RuntimeConfig())
    assert choice.norm == Choice("cpu", "the project's fused C RMSNorm")
    assert select_runtime(RuntimeConfig(fused_norm="on")).norm == Choice(
        "cpu", "set in config; on CPU"
    )
    called.clear()
    assert select_runtime(RuntimeConfig(fused_norm="off")).norm == Choice("torch", "set in config")
    assert "cpu_kernels" not in called  # off asks nothing
    spec = layer_specs.layer_spec(choice)
    assert spec.submodules.input_layernorm is layer_specs.CpuRMSNorm
    assert spec.submodules.pre_mlp_layernorm is layer_specs.CpuRMSNorm


# --------------------------------------------------------------------------- core attention


def test_core_attention_is_sdpa_under_the_local_spec_and_tes_under_te(machine):
    machine(cuda=False)
    choice = select_runtime(RuntimeConfig())
    assert choice.core_attention == Choice("sdpa", "torch scaled_dot_product_attention")
    assert "core_attention=sdpa (torch scaled_dot_product_attention)" in choice.describe()
    assert select_runtime(RuntimeConfig(core_attention="megatron")).core_attention == Choice(
        "megatron", "set in config"
    )
    machine(cuda=True, transformer_engine=True)
    assert select_runtime(RuntimeConfig(layer_spec="te")).core_attention.value == "te"
    # a GPU without TE: the local spec, so SDPA again
    machine(cuda=True)
    assert select_runtime(RuntimeConfig(core_attention="sdpa")).core_attention.value == "sdpa"


@pytest.mark.parametrize("value", ["sdpa", "megatron"])
def test_core_attention_asked_for_under_the_te_spec_is_refused(machine, value):
    machine(cuda=True, transformer_engine=True)
    with pytest.raises(ConfigError) as info:
        select_runtime(RuntimeConfig(layer_spec="te", core_attention=value))
    assert info.value.where == "runtime.core_attention"
    assert "layer_spec=te" in str(info.value) and "runtime.layer_spec=local" in str(info.value)


def test_core_attention_choice_routes_the_local_spec():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from attnres_dist.model.sdpa_attention import SdpaAttention, SdpaSelfAttention

    def core(value):
        values = ("cpu", "local", "torch", "torch", "fp32", value)
        spec = layer_specs.layer_spec(RuntimeChoice(*[Choice(v, "test") for v in values]))
        attention = spec.submodules.self_attention
        return attention.module, attention.submodules.core_attention

    assert core("sdpa") == (SdpaSelfAttention, SdpaAttention)
    assert core("megatron") == (SelfAttention, DotProductAttention)
    # the spec is built fresh: no state leaks between calls
    assert core("sdpa") == (SdpaSelfAttention, SdpaAttention)
    assert RuntimeChoice.reference().core_attention.value == "megatron"


# ----------------------------------------------------------------------------------- config


def test_runtime_section_defaults_to_auto_and_reads_yaml_on_off():
    cfg = load_config("configs/tiny.yaml")
    assert cfg.runtime == RuntimeConfig("auto", "auto", "auto", "auto", "auto")
    # YAML 1.1 reads a bare on/off as a boolean; the section turns it back into the word
    cfg = load_config("configs/tiny.yaml", ["runtime.fused_norm=on", "runtime.fused_optimizer=off"])
    assert (cfg.runtime.fused_norm, cfg.runtime.fused_optimizer) == ("on", "off")
    assert config_from_dict(cfg.to_dict()).runtime == cfg.runtime


@pytest.mark.parametrize(
    "override, field",
    [
        ("runtime.layer_spec=transformer_engine", "runtime.layer_spec"),
        ("runtime.fused_norm=maybe", "runtime.fused_norm"),
        ("runtime.fused_optimizer=apex", "runtime.fused_optimizer"),
        ("runtime.dtype=fp16", "runtime.dtype"),
        ("runtime.core_attention=flash", "runtime.core_attention"),
        ("runtime.precision=bf16", "runtime.precision"),
    ],
)
def test_bad_runtime_words_name_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.yaml", [override])
    assert info.value.where == field


REFUSED_HERE = [
    pytest.param(("runtime.layer_spec=te",), "runtime.layer_spec", id="te"),
    pytest.param(
        ("runtime.compile=layer", "runtime.cuda_graphs=on"),
        "runtime.cuda_graphs",
        id="cuda_graphs",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs CUDA graphs"),
    ),
]


@pytest.mark.parametrize(("asked", "field"), REFUSED_HERE)
def test_trainer_asking_for_what_this_machine_lacks_stops_before_any_process_group(
    asked, field, small_dataset, tmp_path
):
    import torch.distributed as dist

    from attnres_dist.train.trainer import Trainer

    cfg = load_config(
        "configs/tiny.yaml",
        [
            f"data.path={small_dataset}",
            "parallel.pp=1",
            *asked,
            f"output.run_dir={tmp_path / 'run'}",
        ],
    )
    was_initialized = dist.is_initialized()
    with pytest.raises(ConfigError) as info:
        Trainer(cfg)
    assert info.value.where == field
    assert dist.is_initialized() == was_initialized


# ------------------------------------------------------------------------------ application


def test_choices_route_to_megatron_specs_and_optimizers(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    from attnres_dist.pipeline.engine import ClippedAdamW, GlobalNormClip, clipped_optimizer_class

    reference = RuntimeChoice.reference()
    spec = layer_specs.layer_spec(reference)
    # torch's RMSNorm, as Megatron's WrappedTorchNorm builds it but open to sequence parallelism
    assert spec.submodules.input_layernorm is layer_specs.TorchRMSNorm
    config = types.SimpleNamespace(hidden_size=8, layernorm_epsilon=1e-6)
    norm = layer_specs.final_norm(reference, config)
    assert type(norm) is torch.nn.RMSNorm and norm.eps == 1e-6 and norm.weight.shape == (8,)
    assert adam_class(reference) is torch.optim.AdamW
    assert clipped_optimizer_class(torch.optim.AdamW) is ClippedAdamW

    apex = RuntimeChoice(*[Choice(v, "test") for v in ("cuda", "local", "apex", "apex", "fp32")])
    spec = layer_specs.layer_spec(apex)
    assert spec.submodules.input_layernorm is layer_specs.ApexRMSNorm
    assert spec.submodules.pre_mlp_layernorm is layer_specs.ApexRMSNorm
    # the clip composes with any torch optimizer class (apex FusedAdam on GPU machines)
    clipped = clipped_optimizer_class(torch.optim.SGD)
    assert issubclass(clipped, GlobalNormClip) and issubclass(clipped, torch.optim.SGD)

    te = RuntimeChoice(*[Choice(v, "test") for v in ("cuda", "te", "torch", "torch", "fp32")])
    sentinel = object()
    monkeypatch.setattr(
        gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda **kw: sentinel
    )
    assert layer_specs.layer_spec(te) is sentinel


def test_explicit_bf16_is_taken_on_cpu_and_auto_stays_fp32(machine):
    """DeepSpeed's bf16 engine runs on its CPU accelerator: asked for, it is taken; auto is fp32."""
    called = machine()
    choice = select_runtime(RuntimeConfig(dtype="bf16"))
    assert choice.dtype.value == "bf16" and choice.bf16
    reason = "set in config; on CPU; DeepSpeed bf16 engine, fp32 master weights"
    assert choice.dtype.reason == reason
    assert choice.activation_dtype == torch.bfloat16
    auto = select_runtime(RuntimeConfig())
    assert auto.dtype.value == "fp32" and auto.activation_dtype == torch.float32
    assert "bf16" not in called  # no GPU: the bf16 capability probe is never asked
