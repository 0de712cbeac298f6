"""The test tiers and their budgets: the one place every test file is assigned.

* **fast** (``make test``, the README's command): every capability checked at least once, in
  ``FAST_BUDGET_S`` of wall time on 2 cores from a clean clone, set-up included.
* **full** (``make test-full``): every test. CI runs the fast tier, then the rest of the full
  one (``make test-rest``), then the image check, within ``CI_BUDGET_S`` on the slowest machine.

``FILES`` maps every test file to ``FAST`` (all of it is fast), ``FULL`` (none of it is), or the
tests of the file that are fast, by name or by name with its parameters (``name[id]``); the
others of that file, and tests added to it later, run in the full tier only. A name listed
here that matches no test of its file is an error at collection (``conftest.py``), and
``test_tiers.py`` checks that every test file is here. ``CAPABILITIES`` names the fast tests
that check each capability the fast tier promises.
"""

from __future__ import annotations

FAST_BUDGET_S = 15 * 60
CI_BUDGET_S = 75 * 60

FAST, FULL = "fast", "full"

# The files that take longest, longest first (the slowest tests of the tiers, docs/testing.md):
# they run first, so that parallel workers (``make test-rest``), which take a file at a time
# in collection order, do not end on one of them while the other waits.
HEAVY_FIRST = (
    "test_equivalence_grid.py",
    "test_compile.py",
    "test_compile_chunk.py",
    "test_gpu_check.py",
    "test_bench_smoke.py",
    "test_checkpoint.py",
    "test_steady_guards.py",
    "test_pipeline_equivalence.py",
    "test_recompute_dropout.py",
    "test_virtual_equivalence.py",
    "test_precision.py",
    "test_checkpoint_guards.py",
)

FILES: dict[str, str | tuple[str, ...]] = {
    "test_allocator.py": FAST,
    "test_bad_inputs.py": FAST,
    "test_bench_smoke.py": (
        "test_norm_bench_smoke",
        "test_model_bench_smoke",
        "test_peak_bytes_counts_live_tensors_at_their_peak",
        "test_generation_bench_smoke",
    ),
    "test_block_plan.py": FAST,
    "test_check_config_virtual.py": FAST,
    "test_checkpoint.py": (
        "test_exact_resume_same_layout_with_dropout",
        "test_resume_from_a_checkpoint_with_unpacked_mixers",
        "test_reshard_from_two_stages[pp1-dp2-tp2]",
    ),
    "test_checkpoint_guards.py": (
        "test_non_finite_loss_stops_and_names_last_good_checkpoint",
        "test_lost_neighbour_is_named",
    ),
    "test_checkpoint_store.py": FAST,
    "test_cited_paths.py": FAST,
    "test_code_corpus.py": FAST,
    "test_comm_device.py": FULL,
    "test_compile.py": (
        "test_compile_choice_takes_traceable_ops",
        "test_compile_refuses_what_it_does_not_trace",
        "test_every_layer_traces_as_one_graph",
        "test_inductor_matches_eager[block-4]",
    ),
    "test_compile_chunk.py": (
        "test_a_run_traces_as_one_graph",
        "test_recompute_with_chunks_matches_eager[block-4-attnres]",
    ),
    "test_contract.py": FAST,
    "test_core_binding.py": FAST,
    "test_cpu_merge_norm.py": FAST,
    "test_cpu_rms_norm.py": FAST,
    "test_cuda.py": FAST,
    "test_cuda_graphs.py": FAST,
    "test_data.py": FAST,
    "test_default_corpus.py": FAST,
    "test_delta_attnres.py": FAST,
    "test_deferred_skip.py": FULL,
    "test_depth_attention.py": FAST,
    "test_diagnostics.py": (
        "test_zero_queries_give_uniform_weights",
        "test_rms_and_weights_equal_direct_computation",
        "test_recompute_passes_are_not_measured_again",
        "test_gradient_norms_equal_torch_norms_before_clipping",
        "test_off_by_default_and_validated",
        "test_lr_sweep_picks_each_architectures_lowest_mean_loss",
    ),
    "test_docker.py": FAST,
    "test_documents.py": FULL,
    "test_equivalence_grid.py": FAST,
    "test_export.py": (
        "test_export_holds_exactly_the_trained_parameters",
        "test_export_loads_and_generates_without_deepspeed",
        "test_export_of_a_missing_run_is_one_line",
        "test_hf_export_loads_and_generates_without_deepspeed_or_megatron",
        "test_generate_refuses_a_missing_gpu_in_one_line",
    ),
    "test_gpu_check.py": (
        "test_unresolvable_wheels_are_installed_without_deps_and_the_conflict_reported",
        "test_a_step_past_its_limit_is_killed_with_what_it_started_and_its_output_kept",
        "test_the_report_renders_rows_cut_short_and_a_partial_profile",
        "test_host_calls_count_launches_and_blocking_calls_per_step",
        "test_sync_sites_name_the_lines_that_synchronise",
        "test_speed_checks_hold_each_floor_to_the_fastest_path",
    ),
    "test_gpu_study.py": FULL,
    "test_hf_export.py": FAST,
    "test_host_work.py": FULL,
    "test_import_hf.py": FAST,
    "test_import_hf_runs.py": FULL,
    "test_interleaved_schedule.py": FAST,
    "test_kernel_bench.py": FAST,
    "test_kernel_time.py": FAST,
    "test_launch_env.py": FAST,
    "test_launcher_dry_run.py": FAST,
    "test_launcher_jobs.py": (
        "test_real_two_stage_job_on_one_node[torchrun-1f1b]",
        "test_real_two_stage_job_on_one_node[deepspeed-1f1b]",
        "test_real_two_stage_job_on_one_node[mpirun-1f1b]",
        "test_real_two_stage_job_on_two_simulated_nodes[mpirun]",
    ),
    "test_layer_reference.py": FAST,
    "test_layering.py": FAST,
    "test_megatron_jit.py": FULL,
    "test_moe.py": FAST,
    "test_moe_equivalence.py": (
        "test_layout_matches_single_process[ep2-block-attnres]",
        "test_layout_matches_single_process[pp2-ep2-block-full-recompute]",
        "test_layout_matches_single_process[dualpipev-ep2-full]",
        "test_checkpoint_reshards_across_expert_layouts",
        "test_resume_at_the_same_layout_is_bitwise",
        "test_optimizer_wrappers_with_split_experts[zero1-ep2-block]",
    ),
    "test_sequence_parallel.py": (
        "test_sequence_parallel_matches_single_process[tp2-block]",
        "test_sequence_parallel_matches_single_process[tp2-moe-block]",
        "test_sequence_parallel_matches_single_process[pp2-tp2-full]",
        "test_sequence_parallel_matches_single_process[dp2-ep2-tp2-moe-block]",
        "test_profiled_boundary_bytes_per_rank_fall_by_tp",
        "test_moe_checkpoint_reshards_from_tensor_to_expert_parallel",
    ),
    "test_model.py": FAST,
    "test_model_two_phase.py": FAST,
    "test_multinode.py": (
        "test_slurm_dry_run_prints_the_srun_line_and_every_nodes_torchrun",
        "test_slurm_dry_run_expands_host_lists_and_passes_srun_args",
        "test_slurm_script_header_and_refusals",
        "test_torchrun_takes_node_rank_from_slurm_nodeid",
        "test_mpirun_dry_run_passes_extra_hydra_options",
    ),
    "test_outside_kernels.py": FAST,
    "test_paired_ratio.py": FAST,
    "test_pipeline_equivalence.py": FULL,
    "test_precision.py": FULL,
    "test_prefetch.py": FAST,
    "test_profile.py": (
        "test_profile_bytes_equal_contract[pp2-baseline]",
        "test_profile_bytes_equal_contract[pp2-block]",
        "test_profile_bytes_equal_contract[pp2-full]",
        "test_profile_bytes_equal_contract[pp2-delta_block]",
        "test_profile_outputs_well_formed[pp2-block]",
        "test_timeline_covers_every_stage_and_micro_batch[pp2]",
        "test_profile_needs_a_pipeline",
        "test_bad_profile_options",
        "test_paper_volumes",
        "test_latency_bandwidth_fit",
        "test_analysis_pairs_send_and_receive",
    ),
    "test_profile_virtual.py": FAST,
    "test_recompute_dropout.py": (
        "test_recompute_is_exact_under_dropout",
        "test_dropout_is_active_and_keyed",
        "test_layer_masks_do_not_depend_on_earlier_draws",
        "test_plain_torch_checkpoint_would_replay_other_masks",
    ),
    "test_runtime.py": FAST,
    "test_runtime_graphs.py": FAST,
    "test_samples.py": FAST,
    "test_schedule_exec.py": FULL,
    "test_sdpa_attention.py": FAST,
    "test_signals.py": (
        "test_matmul_flops_equal_flop_counter",
        "test_depth_flops_equal_counted_matmul_products",
        "test_mfu_and_peaks",
    ),
    "test_speed_floor.py": FAST,
    "test_stage_cache.py": FAST,
    "test_stage_cache_plan.py": FAST,
    "test_steady_guards.py": FULL,
    "test_study_report.py": FAST,
    "test_tiers.py": FAST,
    "test_train.py": FAST,
    "test_triton_compile.py": FAST,
    "test_triton_two_phase.py": FULL,
    "test_two_phase.py": FAST,
    "test_virtual_equivalence.py": ("test_two_ranks_match_reference[interleaved-block-cache]",),
}

# capability -> the fast tests that check it (file::name prefix); test_tiers.py holds each to
# a fast test that exists
CAPABILITIES: dict[str, tuple[str, ...]] = {
    "single-process engine": ("test_train.py::test_single_process_runs_repeat_exactly",),
    "1F1B, DualPipeV, interleaved; pp, dp, tp; baseline, Block, Full, Delta Block, Delta "
    "Full; both recompute modes; bf16; compiled pipelines": (
        "test_equivalence_grid.py::test_case_matches_single_process",
    ),
    "Delta AttnRes against its float64 definition, every CPU backend": (
        "test_delta_attnres.py",
        "test_import_hf.py::test_delta_block_import_is_the_source_with_each_block_s_partial_sum_damped",
    ),
    "MoE layers (Megatron-Core's MoELayer) against their float64 definition, router losses "
    "and routing statistics": ("test_moe.py",),
    "expert parallelism beside pp, dp, DualPipeV, interleaved, both recomputes, ZeRO-1; "
    "checkpoints resharded across ep, resumed bitwise": (
        "test_moe_equivalence.py::test_layout_matches_single_process",
        "test_moe_equivalence.py::test_checkpoint_reshards_across_expert_layouts",
        "test_moe_equivalence.py::test_resume_at_the_same_layout_is_bitwise",
        "test_moe_equivalence.py::test_optimizer_wrappers_with_split_experts",
    ),
    "cross-stage cache on the wire": (
        "test_virtual_equivalence.py::test_two_ranks_match_reference",
    ),
    "every CPU depth-attention backend": (
        "test_depth_attention.py",
        "test_two_phase.py",
        "test_model_two_phase.py",
        "test_cpu_merge_norm.py",
    ),
    "compiled = eager, no graph break": (
        "test_compile.py::test_inductor_matches_eager",
        "test_compile.py::test_every_layer_traces_as_one_graph",
        "test_compile_chunk.py::test_a_run_traces_as_one_graph",
        "test_compile_chunk.py::test_recompute_with_chunks_matches_eager",
    ),
    "recompute exact under dropout": (
        "test_recompute_dropout.py::test_recompute_is_exact_under_dropout",
    ),
    "launchers: torchrun, deepspeed, mpirun, two simulated nodes": (
        "test_launcher_jobs.py::test_real_two_stage_job_on_one_node",
        "test_launcher_jobs.py::test_real_two_stage_job_on_two_simulated_nodes",
        "test_launcher_dry_run.py",
    ),
    "checkpoints: resume, reshard, a damaged newest checkpoint": (
        "test_checkpoint.py::test_exact_resume_same_layout_with_dropout",
        "test_checkpoint.py::test_reshard_from_two_stages",
        "test_checkpoint_store.py::test_damaged_newest_is_skipped_with_a_warning",
    ),
    "Hugging Face export and import": (
        "test_export.py::test_hf_export_loads_and_generates_without_deepspeed_or_megatron",
        "test_hf_export.py",
        "test_import_hf.py::test_imported_logits_equal_transformers",
    ),
    "profiler": ("test_profile.py::test_profile_bytes_equal_contract",),
    "bad inputs": ("test_bad_inputs.py",),
    "the default config trains": ("test_train.py::test_default_config_trains_as_a_pipeline",),
}


def is_fast(file: str, name: str) -> bool:
    """Whether the test ``name`` (with its parameters, ``name[id]``) of ``file`` is fast."""
    tier = FILES[file]
    if isinstance(tier, str):
        return tier == FAST
    return any(matches(entry, name) for entry in tier)


def matches(entry: str, name: str) -> bool:
    """``entry`` names the test ``name``: the same name, or the name without its parameters."""
    return name == entry or ("[" not in entry and name.startswith(entry + "["))
