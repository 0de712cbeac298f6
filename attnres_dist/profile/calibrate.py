"""Start-up calibration of the links between neighbouring pipeline stages.

For every pair of ranks that exchange pipeline payloads (stage s and s+1 of the same data- and
tensor-parallel coordinates) a short ping-pong measures round trips at a few message sizes, one
of them the boundary's real payload. Half the fastest round trip is the one-way time (on a
shared machine interference only ever adds time, so the minimum is the link's own). A fit of
``time = latency + bytes / bandwidth`` (``fit_latency_bandwidth``) is the model the report
uses to predict each boundary's transfer time.

Records of different ranks must share one time axis. Ranks under one kernel (one host, or
network namespaces of one host) read the same monotonic clock, recognised by the kernel's
boot id, so their offset is exactly 0. Otherwise a timestamped exchange estimates it (NTP
style, from the round trip with the least delay); across hosts that is what makes the
timeline and the wait/transfer split meaningful.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from attnres_dist.parallel.comm_device import comm_device, synchronize


@dataclass
class LinkModel:
    sender: int  # global ranks (sender = the earlier stage)
    receiver: int
    sender_stage: int
    latency_s: float
    bandwidth_Bps: float
    clock_offset_s: float  # receiver clock minus sender clock
    clock: str = "shared"  # shared (one kernel's monotonic clock) | estimated
    samples: list[dict] = field(default_factory=list)  # {"bytes", "one_way_s", "median_s"}

    def predict(self, nbytes: int, tensors: int = 1) -> float:
        """Seconds to move ``tensors`` messages totalling ``nbytes`` one way."""
        return tensors * self.latency_s + nbytes / self.bandwidth_Bps

    def to_dict(self) -> dict:
        return asdict(self)


def fit_latency_bandwidth(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Hockney fit of ``t = latency + n / bandwidth``.

    The latency is the smallest message's time; the bandwidth a least-squares slope through
    that point over the larger messages. A free two-parameter fit lets one slow large message
    drive the intercept negative on a busy machine, which says nothing about latency.
    """
    smallest = min(range(len(sizes)), key=lambda i: sizes[i])
    latency = times[smallest]
    rest = [
        (n, t - latency) for i, (n, t) in enumerate(zip(sizes, times, strict=True)) if i != smallest
    ]
    sxx = sum(n * n for n, _ in rest)
    sxy = sum(n * dt for n, dt in rest)
    if sxx <= 0 or sxy <= 0:  # no measurable size dependence: treat as very fast
        return latency, float("inf")
    return latency, sxx / sxy


def _pingpong_leader(peer: int, sizes, reps: int, warmup: int):
    one_way, offsets = [], []
    stamp = torch.zeros(2, dtype=torch.float64, device=comm_device())
    for _ in range(warmup + reps):  # clock offset from small timestamped round trips
        t0 = time.monotonic()
        stamp[0] = t0
        dist.send(stamp, peer)
        dist.recv(stamp, peer)
        synchronize()
        t3 = time.monotonic()
        t1, t2 = float(stamp[0]), float(stamp[1])
        offsets.append(((t3 - t0) - (t2 - t1), ((t1 - t0) + (t2 - t3)) / 2))
    for nbytes in sizes:
        buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=comm_device())
        rtts = []
        for rep in range(warmup + reps):
            start = time.monotonic()
            dist.send(buf, peer)
            dist.recv(buf, peer)
            synchronize()  # NCCL returns before the transfer is done
            if rep >= warmup:
                rtts.append(time.monotonic() - start)
        one_way.append(
            {
                "bytes": buf.numel() * 4,
                "one_way_s": min(rtts) / 2,
                "median_s": statistics.median(rtts) / 2,
            }
        )
    offset = min(offsets[warmup:])[1]
    return one_way, offset


def _pingpong_follower(peer: int, sizes, reps: int, warmup: int) -> None:
    stamp = torch.zeros(2, dtype=torch.float64, device=comm_device())
    for _ in range(warmup + reps):
        dist.recv(stamp, peer)
        synchronize()
        now = time.monotonic()
        stamp[0] = now
        stamp[1] = time.monotonic()
        dist.send(stamp, peer)
    for nbytes in sizes:
        buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=comm_device())
        for _ in range(warmup + reps):
            dist.recv(buf, peer)
            dist.send(buf, peer)


def calibrate_links(
    dims, rank: int, boundary_bytes: dict[int, int], reps: int = 8, warmup: int = 2
) -> list[LinkModel]:
    """Ping-pong every neighbouring pair; every rank returns the full list (collective).

    ``boundary_bytes``: sender stage -> forward payload bytes of that boundary (measured too,
    so the model is anchored at the size that matters).
    """
    pairs = []
    for dp_rank in range(dims.dp):
        for tp_rank in range(dims.tp):
            for stage in range(dims.pp - 1):
                a = dims.rank_of(stage, dp_rank, tp_rank)
                b = dims.rank_of(stage + 1, dp_rank, tp_rank)
                pairs.append((stage, a, b))
    boot_ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(boot_ids, _boot_id())
    mine = []
    # pairs run in one global order; a rank in two pairs finishes the first before the second,
    # so the chain of waits is acyclic
    for stage, a, b in pairs:
        sizes = sorted({8, 64 << 10, 512 << 10, max(int(boundary_bytes.get(stage, 8)), 8)})
        if rank == a:
            samples, offset = _pingpong_leader(b, sizes, reps, warmup)
            xs = [s["bytes"] for s in samples]
            latency, bandwidth = fit_latency_bandwidth(xs, [s["one_way_s"] for s in samples])
            shared = boot_ids[a] is not None and boot_ids[a] == boot_ids[b]
            clock = "shared" if shared else "estimated"
            offset = 0.0 if shared else offset
            mine.append(LinkModel(a, b, stage, latency, bandwidth, offset, clock, samples))
        elif rank == b:
            _pingpong_follower(a, sizes, reps, warmup)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [m.to_dict() for m in mine])
    links = [LinkModel(**d) for part in gathered for d in part]
    return sorted(links, key=lambda m: (m.sender_stage, m.sender))


def _boot_id() -> str | None:
    """Identifies the running kernel: equal ids mean one CLOCK_MONOTONIC (Linux only)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def clock_offsets(links: list[LinkModel], dims) -> dict[int, float]:
    """Each rank's clock minus the clock of stage 0 of its pipeline (chained link offsets)."""
    offsets = {}
    by_sender = {m.sender: m for m in links}
    for dp_rank in range(dims.dp):
        for tp_rank in range(dims.tp):
            total = 0.0
            rank = dims.rank_of(0, dp_rank, tp_rank)
            offsets[rank] = 0.0
            for _ in range(dims.pp - 1):
                link = by_sender[rank]
                total += link.clock_offset_s
                rank = link.receiver
                offsets[rank] = total
    return offsets
