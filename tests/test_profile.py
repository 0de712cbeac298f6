"""The stage communication profiler: bytes vs the contract, outputs, timeline, two simulated hosts.

Real processes over gloo with a tiny model. One ``attnres-dist profile --modes
baseline,full,block`` job per pipeline depth (pp = 2 and 3) profiles all three residual modes;
block size 3 puts partial blocks on some boundaries. Nothing asserts on timings: the machine is
shared, only bytes, counts, coverage and file formats are checked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from attnres_dist.config import load_config
from attnres_dist.pipeline.contract import boundary_specs_for_config
from tests.conftest import REPO, TINY_MODEL, run_job

MODES = ["baseline", "full", "block", "delta_block"]  # Delta: its twin's rows
PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = ["timeline.png", "boundary_bytes.png", "stage_breakdown.png"]
STEPS = 2


def overrides(data: str, run_dir: str, pp: int) -> list[str]:
    return [
        f"data.path={data}",
        *TINY_MODEL,
        f"parallel.pp={pp}",
        f"output.run_dir={run_dir}",
    ]


def profile_cli(pp: int) -> list[str]:
    return [
        "-m",
        "attnres_dist.cli",
        "profile",
        "--warmup",
        "1",
        "--steps",
        str(STEPS),
        "--trace-steps",
        "1",
        "--pingpong-reps",
        "3",
        "--what-if",
        "P=4,V=2,N=8",
    ]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda pp: f"pp{pp}")
def profiled(request, small_dataset, tmp_path_factory):
    """(pp, run_dir, overrides): every mode profiled in one launch, into run_dir/<mode>/."""
    pp = request.param
    run_dir = tmp_path_factory.mktemp(f"profile_pp{pp}")
    args = overrides(small_dataset, str(run_dir), pp)
    run_job([*profile_cli(pp), "--modes", ",".join(MODES), *args], nproc=pp)
    return pp, run_dir, args


def load_profile(run_dir: Path, mode: str) -> dict:
    return json.loads((run_dir / mode / "comm_profile.json").read_text())


def predicted_specs(args: list[str], mode: str):
    cfg = load_config(None, [*args, f"model.attnres.mode={mode}"])
    return boundary_specs_for_config(cfg, vocab_size=256)  # uniform partition: vocab-free


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_profile_bytes_equal_contract(profiled, mode):
    pp, run_dir, args = profiled
    profile = load_profile(run_dir, mode)
    specs = predicted_specs(args, mode)
    assert len(profile["boundaries"]) == len(specs) == pp - 1
    for spec, row in zip(specs, profile["boundaries"], strict=True):
        assert (row["sender"], row["receiver"]) == (spec.sender, spec.receiver)
        assert row["num_tensors"] == spec.num_tensors
        for direction, expected in (
            ("forward", spec.bytes_forward),
            ("backward", spec.bytes_backward),
        ):
            measured = row[direction]
            assert measured["measured_bytes_per_micro_batch"] == expected, (mode, row["name"])
            assert measured["bytes_equal"]
            assert measured["tensors_per_micro_batch"] == 1  # packed: one message
            assert measured["transfers_per_step"] == profile["config"]["micro_batches_per_step"]
    assert profile["bytes_equal_contract"]
    # an independent count: gloo's own send/recv events in the torch.profiler traces
    for trace in profile["traces"].values():
        assert trace["bytes_equal"], trace
        assert trace["gloo_send"]["count"] > 0
    assert profile["run"]["p2p_calls_outside_instructions"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_profile_outputs_well_formed(profiled, mode):
    pp, run_dir, _ = profiled
    out = run_dir / mode
    profile = load_profile(run_dir, mode)
    report = (out / "comm_report.md").read_text()
    assert "| boundary | direction |" in report and "1F1B bubble" in report
    assert "| 4 | 2 | 8 |" in report  # the what-if row asked for on the command line
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG, name
    assert sorted(profile["files"]["traces"]) == [f"trace_rank{r}.json" for r in range(pp)]
    for rank in range(pp):
        events = json.loads((out / f"trace_rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert "pipe:forward" in names and "pipe:backward" in names
    assert len(profile["stages"]) == pp
    assert len(profile["calibration"]) == pp - 1
    for stage in profile["stages"]:
        assert stage["bubble_1f1b"] == pytest.approx((pp - 1) / (4 + pp - 1))
        assert 0.0 <= stage["idle_fraction"] <= 1.0
    assert set(profile["modes"]) == {"baseline", "full", "block (S=3)"}
    # DeepSpeed's one-off shape metadata is seen, and kept apart from the payload bytes
    assert all(b > 0 for b in profile["run"]["shape_metadata_bytes"].values())


@pytest.mark.slow
def test_timeline_covers_every_stage_and_micro_batch(profiled):
    pp, run_dir, _ = profiled
    for mode in MODES:
        profile = load_profile(run_dir, mode)
        micro_batches = profile["config"]["micro_batches_per_step"]
        timeline = profile["timeline"]
        steps = sorted({e["step"] for e in timeline})
        assert len(steps) == STEPS
        for step in steps:
            for stage in range(pp):
                mine = [e for e in timeline if e["step"] == step and e["stage"] == stage]
                for kind in ("forward", "backward"):
                    seen = sorted(e["micro_batch"] for e in mine if e["kind"] == kind)
                    assert seen == list(range(micro_batches)), (mode, step, stage, kind)
                sends = [e for e in mine if e["kind"] in ("send_act", "send_grad")]
                assert len(sends) == micro_batches * (1 if stage in (0, pp - 1) else 2)
                assert all(e["start"] <= e["end"] for e in mine)


# Interleaved 1F1B (2 ranks x 2 chunks, one layer each) with the naive payload. By hand, with
# block size 3 (blocks close after sublayers 3, 6 and 8) and [s, b, h] = [16, 2, 32] fp32 =
# 4,096 bytes per tensor: chunk 0 -> 1 carries b0 + partial, 1 -> 2 b0, b1 + partial,
# 2 -> 3 b0, b1, b2; cached it would be 2, 2 and 1 tensors (rank 0 holds b0, rank 1 b0, b1).
VIRTUAL_NAIVE_BYTES = [2 * 4096, 3 * 4096, 3 * 4096]
VIRTUAL_CACHED_BYTES = [2 * 4096, 2 * 4096, 1 * 4096]


@pytest.fixture(scope="module")
def profiled_interleaved(small_dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("profile_interleaved")
    args = [
        *overrides(small_dataset, str(run_dir), 2),
        "parallel.schedule=interleaved",
        "parallel.virtual_stages=2",
        "parallel.cross_stage_cache=true",
    ]
    run_job([*profile_cli(2), *args], nproc=2)
    return json.loads((run_dir / "comm_profile.json").read_text()), run_dir


@pytest.mark.slow
def test_profile_interleaved_bytes_per_transition(profiled_interleaved):
    profile, run_dir = profiled_interleaved
    v = profile["virtual"]
    assert v["chunks_of_rank"] == {"0": [0, 2], "1": [1, 3]}
    rows = v["transitions"]
    assert [(r["src_chunk"], r["src_rank"], r["dst_rank"]) for r in rows] == [
        (0, 0, 1),
        (1, 1, 0),
        (2, 0, 1),
    ]
    assert [r["naive_bytes"] for r in rows] == VIRTUAL_NAIVE_BYTES
    assert [r["cached_bytes"] for r in rows] == VIRTUAL_CACHED_BYTES
    M = profile["config"]["micro_batches_per_step"]
    for row, expected in zip(rows, VIRTUAL_CACHED_BYTES, strict=True):  # the cache is on
        for direction in ("forward", "backward"):
            measured = row[direction]
            assert measured["measured_bytes"] == expected, (row["name"], direction)
            assert measured["bytes_equal"] and measured["micro_batches_seen"]
            assert measured["sends"] == measured["recvs"] == M * STEPS
            assert measured["per_step_each_end"] == [M]
    assert profile["bytes_equal_contract"]
    assert v["bytes_per_micro_batch"] == {
        "naive": sum(VIRTUAL_NAIVE_BYTES),
        "cached": sum(VIRTUAL_CACHED_BYTES),
        "sent": sum(VIRTUAL_CACHED_BYTES),
    }
    for trace in profile["traces"].values():  # gloo's own count of the traced step
        assert trace["bytes_equal"], trace
    assert profile["run"]["p2p_calls_outside_instructions"] == 0


@pytest.mark.slow
def test_profile_interleaved_bubble_and_timeline(profiled_interleaved):
    profile, run_dir = profiled_interleaved
    b = profile["bubble"]
    M = profile["config"]["micro_batches_per_step"]
    assert b["schedule"] == "interleaved" and b["virtual_stages"] == 2
    assert b["theoretical"] == pytest.approx(1 / (2 * M + 1))  # (P - 1) / (V M + P - 1)
    assert len(b["measured"]["per_step"]) == STEPS
    assert all(0.0 <= x < 1.0 for x in b["measured"]["per_step"])
    for step in sorted({e["step"] for e in profile["timeline"]}):
        for rank, chunks in ((0, [0, 2]), (1, [1, 3])):
            mine = [e for e in profile["timeline"] if e["step"] == step and e["rank"] == rank]
            for kind in ("forward", "backward"):
                seen = sorted((e["chunk"], e["micro_batch"]) for e in mine if e["kind"] == kind)
                assert seen == [(c, m) for c in chunks for m in range(M)], (step, rank, kind)
    report = (run_dir / "comm_report.md").read_text()
    assert "| chunk 1 -> 2 (rank 1 -> 0) | 2 | [3, 16, 2, 32] | 12,288 | [2, 16, 2, 32] |" in report
    assert "interleaved 1F1B (V = 2)" in report
    for name in PLOTS:
        assert (run_dir / name).read_bytes()[:8] == PNG, name


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2's ip and tc"
    probe = f"attnres-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.mark.slow
def test_two_simulated_hosts_with_bandwidth_cap(small_dataset, tmp_path):
    reason = _netns_unavailable()
    if reason:
        pytest.skip(f"two-host profile skipped: {reason}")
    run_dir = tmp_path / "netns"
    env = dict(os.environ, RATE="1gbit", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        "bash",
        str(REPO / "launch" / "netns-two-nodes.sh"),
        *profile_cli(2)[3:],
        *overrides(small_dataset, str(run_dir), 2),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    profile = json.loads((run_dir / "comm_profile.json").read_text())
    assert profile["bytes_equal_contract"]
    assert (run_dir / "timeline.png").read_bytes()[:8] == PNG
    assert len(profile["calibration"]) == 1
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"attnres-{proc.pid}" not in leftover  # the script removed its namespaces


def test_profile_needs_a_pipeline(capsys):
    from attnres_dist.cli import main

    assert main(["profile", "--config", str(REPO / "configs" / "tiny.yaml"), "parallel.pp=1"]) == 2
    assert "parallel.pp" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, where",
    [
        (["--modes", "full,resnet"], "--modes"),
        (["--what-if", "P=4,Q=2"], "--what-if"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_profile_options(flags, where, capsys):
    from attnres_dist.cli import main

    assert main(["profile", *flags]) == 2
    assert where in capsys.readouterr().err


# -- pure functions (no processes) -------------------------------------------------------------


def test_paper_volumes():
    from attnres_dist.profile.volumes import caching_volume, naive_volume, what_if_row

    assert naive_volume(4, 2, 1) == 28  # C = 8: 8 * 7 / 2
    assert caching_volume(4, 2, 1) == 6 + 16  # P(P-1)/2 + (V-1) P^2
    assert naive_volume(4, 1, 2) == caching_volume(4, 1, 2) == 12  # V = 1: nothing to cache
    row = what_if_row(4, 2, 8, hidden=128, itemsize=4)
    assert row["N_p"] == 1 and row["naive_bytes_per_token"] == 28 * 128 * 4


def test_latency_bandwidth_fit():
    from attnres_dist.profile.calibrate import fit_latency_bandwidth

    sizes = [8, 1 << 16, 1 << 20, 3 << 20]
    latency, bandwidth = fit_latency_bandwidth(sizes, [1e-4 + n / 2e9 for n in sizes])
    assert latency == pytest.approx(1e-4, rel=1e-3)
    assert bandwidth == pytest.approx(2e9, rel=1e-3)


def test_analysis_pairs_send_and_receive():
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.pipeline.contract import BoundarySpec
    from attnres_dist.profile.analysis import analyze

    def transfer(rank, stage, peer, op, start, end):
        return {
            "rank": rank,
            "stage": stage,
            "peer_stage": peer,
            "op": op,
            "direction": "forward",
            "step": 0,
            "micro_batch": 0,
            "start": start,
            "end": end,
            "shapes": [[1, 1, 1, 25]],
            "dtypes": ["float32"],
            "nbytes": 100,
            "meta_bytes": 0,
        }

    def event(rank, stage, kind, start, end):
        return {
            "rank": rank,
            "stage": stage,
            "step": 0,
            "kind": kind,
            "micro_batch": 0,
            "start": start,
            "end": end,
        }

    ranks = [
        {
            "rank": 0,
            "offset": 0.0,
            "steps": [(0, 0.0, 3.0)],
            "events": [event(0, 0, "forward", 0.0, 1.0), event(0, 0, "send_act", 1.0, 1.1)],
            "transfers": [transfer(0, 0, 1, "send", 1.0, 1.1)],
        },
        {
            "rank": 1,
            "offset": 0.0,
            "steps": [(0, 0.0, 3.0)],
            "events": [event(1, 1, "recv_act", 0.5, 1.5), event(1, 1, "forward", 1.5, 2.5)],
            "transfers": [transfer(1, 1, 0, "recv", 0.5, 1.5)],
        },
    ]
    spec = BoundarySpec(0, 1, 2, "blocks", (1, 1, 1, 25), "float32", 100, 100)
    out = analyze(ranks, ParallelDims(2, 1, 1), [spec], [], 1, 16)
    fwd = out["boundaries"][0]["forward"]
    assert fwd["measured_bytes_per_micro_batch"] == 100 and fwd["bytes_equal"]
    assert fwd["transfer_s"]["median"] == pytest.approx(0.5)  # from the sender's start
    assert fwd["recv_wait_s"]["median"] == pytest.approx(0.5)  # receiver waited for it
    stage1 = out["stages"][1]
    assert stage1["forward_s"] == pytest.approx(1.0)
    assert stage1["idle_s"] == pytest.approx(3.0 - 1.0 - 0.5)
    recv = next(e for e in out["timeline"] if e["kind"] == "recv_act")
    assert recv["ready"] == pytest.approx(1.0)
