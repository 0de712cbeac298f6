"""Checkpoints that survive crashes and resharding.

``store``: the on-disk format, crash-safe commits, verification and selection (no torch).
``state``: a run's model, optimizer, schedule and RNG <-> a checkpoint, for any layout.
``manager``: what the trainer uses (resolve what to resume before anything starts; save).
``faults``: test-only fault injection (kill or stall one rank at a chosen point).
"""
