"""Turn the raw records of every rank into the numbers of ``comm_profile.json``.

Inputs per rank: schedule ``Event``s, wire ``Transfer``s, step start/end times and the clock
offset from calibration. All times are first moved onto one axis (stage 0's clock). A send and
a receive of the same boundary, direction, pipeline chain, step and micro-batch are the two
ends of one transfer; both ends block in gloo until the other side is there, so each end's wall
time includes waiting. The part when both ranks are ready,
``recv.end - max(send.start, recv.start)``, is reported as the transfer time; bandwidth and the
model comparison use it, and the waits go to the idle time of the waiting stage.

Per stage and step: ``idle = step - forward - backward - transfer - other`` where *other* is
loading, gradient reduction and the optimizer step; averaged over the measured steps it is set
next to the 1F1B bubble ``(P - 1) / (M + P - 1)``.
"""

from __future__ import annotations

import math
from collections import defaultdict

from attnres_dist.profile.schedule import COMM_KINDS, OTHER_KINDS
from attnres_dist.profile.wire import expected_wire_bytes, stage_pair

KIND_TO_TRANSFER = {
    "send_act": ("send", "forward"),
    "recv_act": ("recv", "forward"),
    "send_grad": ("send", "backward"),
    "recv_grad": ("recv", "backward"),
}


def quantile(values, q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    pos = q * (len(values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summary(values) -> dict:
    values = list(values)
    return {"median": quantile(values, 0.5), "p90": quantile(values, 0.9), "n": len(values)}


def _align(ranks: list[dict]) -> float:
    """Shift every record of every rank onto stage 0's clock; returns the common origin."""
    for r in ranks:
        off = r["offset"]
        for e in r["events"]:
            e["start"] -= off
            e["end"] -= off
        for t in r["transfers"]:
            t["start"] -= off
            t["end"] -= off
        r["steps"] = [(s, a - off, b - off) for s, a, b in r["steps"]]
    return min(a for r in ranks for _, a, _ in r["steps"])


def _match(ranks: list[dict], dims) -> list[dict]:
    """Pair each send with its receive: one dict per transfer with both ends."""
    ends: dict[tuple, dict] = {}
    for r in ranks:
        _, dp_rank, tp_rank = dims.coords(r["rank"])
        for t in r["transfers"]:
            sender, receiver = t["stage_pair"]
            chunk = t.get("chunk", -1)  # virtual stages: several transitions per rank pair
            key = (sender, receiver, t["direction"], dp_rank, tp_rank, t["step"], t["micro_batch"])
            ends.setdefault(key + (chunk,), {})[t["op"]] = t
    pairs = []
    for key, both in ends.items():
        if "send" not in both or "recv" not in both:
            continue
        send, recv = both["send"], both["recv"]
        ready = max(send["start"], recv["start"])
        pairs.append(
            {
                "boundary": key[:2],
                "direction": key[2],
                "step": key[5],
                "micro_batch": key[6],
                "chunk": key[7],
                "send": send,
                "recv": recv,
                "transfer_s": max(recv["end"] - ready, 0.0),
                "recv_wait_s": max(send["start"] - recv["start"], 0.0),
                "send_wait_s": max(recv["start"] - send["start"], 0.0),
            }
        )
    return pairs


def _boundary_rows(specs, pairs, links, tp: int, partitioned: dict) -> list[dict]:
    link_of = {}
    for link in links:
        link_of.setdefault(link.sender_stage, link)  # first chain's link per boundary
    rows = []
    for spec in specs:
        row = spec.to_dict()
        for direction in ("forward", "backward"):
            predicted = spec.bytes_forward if direction == "forward" else spec.bytes_backward
            itemsize = predicted // _numel(spec.shape)
            wire = expected_wire_bytes(spec.shape, itemsize, tp, partitioned[direction])
            mine = [p for p in pairs if p["boundary"] == (spec.sender, spec.receiver)]
            mine = [p for p in mine if p["direction"] == direction]
            sends = [p["send"] for p in mine]
            measured = sorted({t["nbytes"] for p in mine for t in (p["send"], p["recv"])})
            tensors = sorted({len(t["shapes"]) for p in mine for t in (p["send"], p["recv"])})
            per_step = defaultdict(int)
            for t in sends:
                per_step[(t["rank"], t["step"])] += 1
            transfer = [p["transfer_s"] for p in mine]
            med = quantile(transfer, 0.5)
            link = link_of.get(spec.sender)
            messages = tensors[0] if len(tensors) == 1 else 1
            sent = max(wire)  # what one rank moves (a slice of it with tensor parallelism)
            row[direction] = {
                "predicted_bytes_per_micro_batch": predicted,
                "measured_bytes_per_micro_batch": measured[0] if len(measured) == 1 else measured,
                "expected_wire_bytes_per_rank": sorted(set(wire)),
                "bytes_equal": measured == sorted(set(wire)),
                "tensors_per_micro_batch": tensors[0] if len(tensors) == 1 else tensors,
                "transfers_per_step": quantile(list(per_step.values()), 0.5),
                "send_s": summary(t["end"] - t["start"] for t in sends),
                "recv_s": summary(p["recv"]["end"] - p["recv"]["start"] for p in mine),
                "transfer_s": summary(transfer),
                "recv_wait_s": summary(p["recv_wait_s"] for p in mine),
                "achieved_Bps": sent / med if med and med > 0 else float("nan"),
                "model_s": link.predict(sent, messages) if link else float("nan"),
            }
        rows.append(row)
    return rows


def _numel(shape) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


def _stage_rows(ranks, pairs, dims, num_micro_batches: int) -> list[dict]:
    comm = defaultdict(float)  # (rank, step) -> effective transfer seconds
    for p in pairs:
        for end in (p["send"], p["recv"]):
            comm[(end["rank"], p["step"])] += p["transfer_s"]
    samples = defaultdict(lambda: defaultdict(list))
    per_mb = defaultdict(lambda: defaultdict(list))
    for r in ranks:
        stage = dims.coords(r["rank"])[0]
        by_step = defaultdict(lambda: defaultdict(float))
        for e in r["events"]:
            dur = e["end"] - e["start"]
            kind = e["kind"]
            if kind in ("forward", "backward"):
                by_step[e["step"]][kind] += dur
                per_mb[stage][kind].append(dur)
            elif kind in OTHER_KINDS:
                by_step[e["step"]]["other"] += dur
        for step, start, end in r["steps"]:
            d = by_step[step]
            total = end - start
            c = comm[(r["rank"], step)]
            idle = max(total - d["forward"] - d["backward"] - c - d["other"], 0.0)
            for key, value in (
                ("step_s", total),
                ("forward_s", d["forward"]),
                ("backward_s", d["backward"]),
                ("transfer_s", c),
                ("other_s", d["other"]),
                ("idle_s", idle),
            ):
                samples[stage][key].append(value)
    P, M = dims.pp, num_micro_batches
    bubble = (P - 1) / (M + P - 1)
    rows = []
    for stage in sorted(samples):
        row = {"stage": stage, "bubble_1f1b": bubble}
        # means, not medians: the parts of a step then add up to the step
        row |= {key: sum(vals) / len(vals) for key, vals in samples[stage].items()}
        row["idle_fraction"] = row["idle_s"] / row["step_s"] if row["step_s"] > 0 else 0.0
        row["forward_per_micro_batch_s"] = quantile(per_mb[stage]["forward"], 0.5)
        row["backward_per_micro_batch_s"] = quantile(per_mb[stage]["backward"], 0.5)
        rows.append(row)
    return rows


def _timeline(ranks, pairs, dims, origin: float) -> list[dict]:
    ready = {}
    committed = defaultdict(list)  # rank -> (start of its end, both ends ready): commits
    for p in pairs:
        both = max(p["send"]["start"], p["recv"]["start"])
        for end in (p["send"], p["recv"]):
            ready[(end["rank"], end["step"], end["op"], end["direction"], end["micro_batch"])] = (
                both
            )
            committed[end["rank"]].append((end["start"], both))
    out = []
    for r in ranks:
        for e in r["events"]:
            item = {
                "rank": r["rank"],
                "stage": dims.coords(r["rank"])[0],
                "step": e["step"],
                "kind": e["kind"],
                "micro_batch": e["micro_batch"],
                "chunk": e.get("chunk", -1),
                "start": e["start"] - origin,
                "end": e["end"] - origin,
            }
            if e["kind"] in COMM_KINDS:
                op, direction = KIND_TO_TRANSFER[e["kind"]]
                key = (r["rank"], e["step"], op, direction, e["micro_batch"])
                if key in ready:  # the part before the peer was ready is waiting
                    item["ready"] = min(max(ready[key] - origin, item["start"]), item["end"])
            elif e["kind"] == "commit":  # a batch: waiting until the last peer is there
                mine = [b for a, b in committed[r["rank"]] if e["start"] <= a <= e["end"]]
                if mine:
                    item["ready"] = min(max(max(mine) - origin, item["start"]), item["end"])
            out.append(item)
    return sorted(out, key=lambda x: (x["rank"], x["start"]))


def analyze(
    ranks, dims, specs, links, num_micro_batches: int, tokens_per_step: int, partitioned=None
) -> dict:
    """``ranks``: one dict per rank with rank, offset, events, transfers, steps (plain dicts).

    ``partitioned``: {"forward": bool, "backward": bool}, whether DeepSpeed splits payloads
    over tensor-parallel ranks (the engine's ``is_pipe_partitioned`` / ``is_grad_partitioned``).
    """
    partitioned = partitioned or {"forward": False, "backward": False}
    for r in ranks:
        for t in r["transfers"]:
            t["stage_pair"] = stage_pair(t["op"], t["direction"], t["stage"], t["peer_stage"])
    origin = _align(ranks)
    pairs = _match(ranks, dims)
    step_ids = sorted({s for r in ranks for s, _, _ in r["steps"]})
    step_times = []
    for step in step_ids:
        spans = [(a, b) for r in ranks for s, a, b in r["steps"] if s == step]
        step_times.append(max(b for _, b in spans) - min(a for a, _ in spans))
    return {
        "step_s": summary(step_times),
        "tokens_per_s": summary(tokens_per_step / t for t in step_times if t > 0),
        "boundaries": _boundary_rows(specs, pairs, links, dims.tp, partitioned),
        "stages": _stage_rows(ranks, pairs, dims, num_micro_batches),
        "timeline": _timeline(ranks, pairs, dims, origin),
    }
