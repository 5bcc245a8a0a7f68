"""Every seed a run derives, in one place, from `trainer.seed` down to one turn of one sample.

Each formula is what a run's samples are made of: changing one changes every seeded run's
samples (and the resume-exactness of runs checkpointed before). Python's `hash` of ints and
tuples of ints is the same in every process (only str and bytes hashing is salted).
"""
from __future__ import annotations

from typing import Sequence

MODULUS = 2 ** 31


def round_seed(run_seed: int, step: int, round_: int = 0) -> int:
    """A step's generation round (round 0 is the step's own; DAPO's refills are rounds 1, 2, ...)."""
    return run_seed * 1_000_003 + step + round_ * 1_000_000_007


def regenerated_seed(run_seed: int, step: int) -> int:
    """The round that regenerates an async batch's groups found too stale."""
    return run_seed * 1_000_003 + step + 7_777_777


def engine_seed(pool_seed: int, worker: int) -> int:
    return pool_seed + worker


def prompt_seed(round_seed_: int, index: int) -> int:
    """One prompt's seed in a round, the same on whichever worker its chunk lands."""
    return hash((round_seed_, index)) % MODULUS


def call_seed(prompt_seeds: Sequence[int]) -> int:
    """The engine's sampler seed for one call when requests carry none (unseeded sampling)."""
    return hash(tuple(prompt_seeds)) % MODULUS


def sample_seed(prompt_seed_: int, sample: int) -> int:
    """Sample j of a prompt's group, in an episode or an agent session."""
    return prompt_seed_ * 1009 + sample


def turn_seed(sample_seed_: int, turn: int) -> int:
    """Turn t of one episode or session."""
    return (sample_seed_ + 7919 * turn) % MODULUS


def warmup_seed(run_seed: int, steps_done: int) -> int:
    return run_seed + steps_done


def epoch_seed(sampler_seed: int, epoch: int) -> int:
    """The prompt sampler's shuffle of one epoch."""
    return sampler_seed + epoch
