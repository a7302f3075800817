"""How a prepared DataLoader's shuffling sampler gets its random numbers, epoch after epoch.

The order is Accelerate's for the same seed, and every policy can name its position so that a
resumed run (``load_state``) draws the interrupted epoch's order again:

- :class:`SharedGenerator` (the default, several processes; also one process whose sampler has a
  generator): the sampler shuffles with one generator. With several processes it is seeded once
  at ``prepare`` from torch's global RNG (unless the sampler brought one) and every epoch starts
  from rank 0's state of it, so all ranks walk the same permutation.
- :class:`GlobalRngAtPass` (one process, a sampler without a generator): the sampler as it is,
  drawing from torch's global RNG when the epoch's pass begins.
- :class:`SeededByEpoch` (``use_seedable_sampler=True``): a :class:`SeedableRandomSampler`,
  epoch ``e`` shuffles with ``seed + e``; ``seed`` is ``data_seed`` or torch's initial seed,
  taken from rank 0.

Example::

    policy = SharedGenerator(sampler_generator=None, num_processes=2)
    sampler = HookedSampler(copy.copy(user_sampler), policy)   # sampler.generator is policy's
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import RandomSampler, Sampler

from nblaunch.training.runtime.collectives import synchronize_rng_states

__all__ = ["ShufflePolicy", "SharedGenerator", "GlobalRngAtPass", "SeededByEpoch", "SeedableRandomSampler", "HookedSampler"]


def _draw_seed() -> int:
    # The draw torch's RandomSampler makes when it has no generator.
    return int(torch.empty((), dtype=torch.int64).random_().item())


class ShufflePolicy:
    """Owns the generator a shuffling sampler uses and says when it is (re)set."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator  # the sampler's (None: it draws from torch's global RNG)
        self.epoch = 0
        self._resume: dict | None = None

    def before_epoch(self, epoch: int) -> None:
        """At the start of an epoch, before the DataLoader's iterator is made."""
        self.epoch = epoch

    def at_sampler_start(self) -> None:
        """When the sampler begins its pass over the data (inside the iterator)."""

    def iterate(self, sampler: Any) -> Iterator[Any]:
        """The sampler's pass."""
        return iter(sampler)

    def position(self, mid_epoch: bool) -> dict:
        """What ``resume`` needs to give the current (or next) epoch the same order."""
        return {}

    def resume(self, position: dict) -> None:
        """Use ``position`` (from :meth:`position`) for the next epoch's order."""
        self._resume = dict(position)


class SharedGenerator(ShufflePolicy):
    """One generator for the sampler (and for the DataLoader, if it shared the sampler's); with
    several processes every epoch starts from rank 0's state of it."""

    def __init__(self, sampler_generator: torch.Generator | None, num_processes: int) -> None:
        super().__init__(torch.Generator())
        if sampler_generator is not None:
            self.generator.set_state(sampler_generator.get_state())
        elif num_processes > 1:
            self.generator.manual_seed(_draw_seed())
        self.num_processes = num_processes
        self._epoch_start = self.generator.get_state()

    def before_epoch(self, epoch: int) -> None:
        super().before_epoch(epoch)
        saved = self._resume.get("generator_state") if self._resume else None
        self._resume = None
        if saved is not None:
            self.generator.set_state(saved)
        elif self.num_processes > 1:
            synchronize_rng_states(["generator"], self.generator)
        self._epoch_start = self.generator.get_state()

    def position(self, mid_epoch: bool) -> dict:
        return {"generator_state": self._epoch_start if mid_epoch else self.generator.get_state()}


class GlobalRngAtPass(ShufflePolicy):
    """One process, a sampler without a generator: the sampler is left as it is, drawing from
    torch's global RNG when its pass begins (what plain PyTorch and Accelerate do). The RNG
    state at that moment is the position."""

    def __init__(self) -> None:
        super().__init__(None)
        self._pass_state: torch.Tensor | None = None

    def iterate(self, sampler: Any) -> Iterator[Any]:
        saved = self._resume.get("pass_rng_state") if self._resume else None
        self._resume = None
        if saved is None:
            self._pass_state = torch.get_rng_state()
            yield from sampler
            return
        # Resuming: the interrupted run drew from this state before its checkpoint. Draw the same
        # order from it, then give the RNG back the checkpoint's state.
        self._pass_state = saved
        now = torch.get_rng_state()
        torch.set_rng_state(saved)
        iterator = iter(sampler)
        try:
            first = next(iterator, _NOTHING)  # samplers draw when their first index is asked for
        finally:
            torch.set_rng_state(now)
        if first is not _NOTHING:
            yield first
            yield from iterator

    def position(self, mid_epoch: bool) -> dict:
        return {"pass_rng_state": self._pass_state} if mid_epoch else {}


_NOTHING = object()


class SeedableRandomSampler(RandomSampler):
    """Accelerate's ``SeedableRandomSampler``: epoch ``e`` shuffles with ``initial_seed + e``, so
    every rank (and a resumed run) draws the same order. ``data_seed`` (default: torch's initial
    seed, i.e. ``set_seed``'s) is ``initial_seed``.

    Example::

        sampler = SeedableRandomSampler(range(10), data_seed=42)
        sampler.set_epoch(3)
        list(sampler)   # the order of epoch 3, on every process
    """

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class SeededByEpoch(ShufflePolicy):
    """``use_seedable_sampler=True``: the loader's sampler is a :class:`SeedableRandomSampler`,
    told the epoch before each pass."""

    def __init__(self, sampler: SeedableRandomSampler) -> None:
        super().__init__(sampler.generator)
        self.sampler = sampler

    def before_epoch(self, epoch: int) -> None:
        super().before_epoch(epoch)
        if self._resume and self._resume.get("seed") is not None:
            self.sampler.initial_seed = int(self._resume["seed"])
        self._resume = None
        self.sampler.set_epoch(epoch)

    def position(self, mid_epoch: bool) -> dict:
        return {"seed": self.sampler.initial_seed}


class HookedSampler(Sampler):
    """A copy of the user's shuffling sampler, using the policy's generator and telling the
    policy when each pass begins. Other attributes are the wrapped sampler's."""

    def __init__(self, sampler: Any, policy: ShufflePolicy) -> None:
        sampler.generator = policy.generator
        self.sampler = sampler
        self.policy = policy

    def __iter__(self) -> Iterator[Any]:
        self.policy.at_sampler_start()
        return self.policy.iterate(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.sampler, name)
