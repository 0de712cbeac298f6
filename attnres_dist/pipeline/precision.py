"""DeepSpeed's mixed precision and ZeRO-1 for the pipeline engine, and per-parameter views of them.

``runtime.dtype: bf16`` runs DeepSpeed's bf16 engine: parameters, activations and stage-to-stage
payloads in bf16; its ``BF16_Optimizer`` keeps fp32 master weights, accumulates gradients in
fp32 (``data_types.grad_accum_dtype``) and steps the project's ``torch.optim`` AdamW on them.
DeepSpeed 0.19.8 accepts fp32 accumulation with bf16 parameters only under ZeRO stage 1, and its
bf16 optimizer always shards the fp32 master weights and optimizer state over the data-parallel
ranks: with bf16 the engine is ZeRO-1 whatever ``parallel.zero_stage`` says.
``parallel.zero_stage: 1`` in fp32 runs DeepSpeed's ``DeepSpeedZeroOptimizer`` (stage 1): the
fp32 master copy and AdamW state sharded over the data-parallel ranks.

Gradient clipping under these wrappers is DeepSpeed's (``gradient_clipping``): the wrappers own
the flat, accumulated fp32 gradients, and their norm counts every parameter once by the same
rule as the project's ``ClippedAdamW`` (tied copies marked ``ds_pipe_replicated`` off the first
stage are skipped, parameters without ``tensor_model_parallel`` count on tensor rank 0 only,
and the sum runs over the pipeline x tensor ranks of the data-parallel replica).

``ShardedState`` gives the checkpoint code full per-parameter tensors of the wrapper's flat
partitions (DeepSpeed's ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``:
collective over the data-parallel group) and writes them back on load, so a checkpoint holds
the fp32 master weights and AdamW state by canonical name, whatever the layout.
"""

from __future__ import annotations

import torch

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def wrapped(cfg, runtime) -> bool:
    """Whether DeepSpeed's optimizer wrapper (bf16 or ZeRO-1) owns gradients and master weights."""
    return runtime.dtype.value == "bf16" or cfg.parallel.zero_stage == 1


def check_supported(cfg, runtime, world_size: int) -> None:
    """Refuse, before any process group starts, what the wrappers cannot serve."""
    from attnres_dist.errors import ConfigError

    if cfg.parallel.sequence_parallel and wrapped(cfg, runtime):
        raise ConfigError(
            "parallel.sequence_parallel",
            f"true with runtime.dtype={runtime.dtype.value}, parallel.zero_stage="
            f"{cfg.parallel.zero_stage}: the tensor-group sum of its gradients runs on the "
            "fp32 ZeRO-0 path only so far; set runtime.dtype=fp32 and parallel.zero_stage=0",
        )
    deepspeed_engine = world_size > 1 or runtime.dtype.value == "bf16"
    if cfg.metrics.every_k and deepspeed_engine and wrapped(cfg, runtime):
        raise ConfigError(
            "metrics.every_k",
            f"got {cfg.metrics.every_k}; gradient diagnostics read the project's clip point, "
            "which DeepSpeed's bf16 engine and ZeRO-1 replace; set metrics.every_k=0, or "
            "runtime.dtype=fp32 and parallel.zero_stage=0",
        )


def ds_config_section(cfg, runtime) -> dict:
    """The precision, ZeRO and clipping entries of the DeepSpeed config."""
    if not wrapped(cfg, runtime):
        # fp32 ZeRO-0: ClippedAdamW clips with the count-once norm itself
        return {"gradient_clipping": 0.0, "zero_optimization": {"stage": 0}}
    section = {
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": 1},
    }
    if runtime.dtype.value == "bf16":
        section["bf16"] = {"enabled": True}
        section["data_types"] = {"grad_accum_dtype": "fp32"}
    return section


class ShardedState:
    """Full per-parameter views of a DeepSpeed wrapper's flat fp32 partitions."""

    def __init__(self, ds_optimizer, basic: torch.optim.Optimizer):
        self.ds_optimizer = ds_optimizer
        self.basic = basic
        groups = getattr(ds_optimizer, "bf16_groups", None) or ds_optimizer.bit16_groups
        self._group_of = {id(p): i for i, group in enumerate(groups) for p in group}
        self._linked = False

    def _flat(self, param) -> torch.Tensor:
        return self.basic.param_groups[self._group_of[id(param)]]["params"][0]

    def master(self, param) -> torch.Tensor:
        """The fp32 master weight of ``param`` (this rank's tensor shard). Collective over dp."""
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(param)

    def state(self, param) -> dict[str, torch.Tensor]:
        """AdamW's state of ``param``, as torch.optim.AdamW keeps it. Collective over dp."""
        from deepspeed.utils import safe_get_full_optimizer_state

        flat_state = self.basic.state.get(self._flat(param), {})
        if "step" not in flat_state:
            return {}
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None and not all(k in (mapping.optim_fragment or {}) for k in ADAM_KEYS):
            # DeepSpeed's ZeRO-1 links every group's state after stepping the first group
            # only, leaving later groups unlinked; link again now that all states exist
            self._relink()
        state = {key: safe_get_full_optimizer_state(param, key) for key in ADAM_KEYS}
        state["step"] = flat_state["step"].detach().clone()
        return state

    def _ensure_state(self) -> None:
        """AdamW state (zeros, step 0, as its first step would create) linked to the partitions."""
        if self._linked:
            return
        self._linked = True
        for group in self.basic.param_groups:
            flat = group["params"][0]
            state = self.basic.state[flat]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        self._relink()

    def _relink(self) -> None:
        self.ds_optimizer._hp_optimizer_states_linked = False
        self.ds_optimizer._lazy_init_hp_params_optimizer_state()

    def load(self, param, master: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Set ``param`` (and its master copy) to ``master`` and its AdamW state. Local."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        with torch.no_grad():
            param.copy_(master.to(param.dtype))
        safe_set_full_fp32_param(param, master.to(torch.float32))
        if not state:
            return
        self._ensure_state()
        for key in ADAM_KEYS:
            safe_set_full_optimizer_state(param, state[key].to(torch.float32), key)
        self.basic.state[self._flat(param)]["step"] = state["step"].detach().clone().float()
