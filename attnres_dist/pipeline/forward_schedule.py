"""A forward-only pipeline schedule for any chunk layout and any number of micro-batches.

Evaluation on the V shape cannot always use DeepSpeed's forward-only ``DualPipeVSchedule``: it
needs at least 2P micro-batches, and an evaluation may bring fewer. ``SequentialForward`` runs
the micro-batches one after another through all chunks, in the same global order on every
rank: (micro-batch, chunk) ascending. Each activation is sent in a commit of its own right after
its forward and received in a commit right before the consumer's forward; since every rank
walks the one global order, the earliest unfinished message always has both sides ready, so
blocking batched p2p cannot deadlock. It trades the pipelining of evaluation for that
generality (evaluation is a small part of a run).
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds


class SequentialForward(ds.PipeSchedule):
    """Forward passes only; ``chunk_rank(chunk)`` places the C chunks on the P ranks."""

    def __init__(self, micro_batches, stages, stage_id, chunk_rank, num_chunks):
        super().__init__(micro_batches, stages, stage_id)
        self.chunk_rank, self.num_chunks = chunk_rank, num_chunks
        self.mine = [c for c in range(num_chunks) if chunk_rank(c) == stage_id]

    def num_pipe_buffers(self):
        return len(self.mine) * self.micro_batches

    def steps(self):
        M, C, me = self.micro_batches, self.num_chunks, self.stage_id
        for mb in range(M):
            for phase, chunk in enumerate(self.mine):
                buf = phase * M + mb
                cmds = []
                if chunk > 0 and self.chunk_rank(chunk - 1) != me:
                    cmds += [ds.RecvActivation(buf, phase=phase), ds.CommitP2P()]
                # the data once per micro-batch and rank: inputs for chunk 0, labels for C - 1
                first = chunk == 0
                last = chunk == C - 1 and self.chunk_rank(0) != me
                if first or last:
                    cmds.append(ds.LoadMicroBatch(buf))
                cmds.append(ds.ForwardPass(buf, phase=phase))
                if chunk < C - 1 and self.chunk_rank(chunk + 1) != me:
                    cmds += [ds.SendActivation(buf, phase=phase), ds.CommitP2P()]
                yield cmds
