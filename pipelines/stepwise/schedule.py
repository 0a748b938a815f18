"""A row's own schedule: a scheduler of the pipeline's class and config made for the row, its
timesteps set as the family's pipeline sets them (:meth:`Steps.scheduler`), and stepped on the
row alone with the scheduler's own ``step``.

The flow-match Euler update (``sample + (sigma_next - sigma) * model_output``) is elementwise, so a
row updated alone gets the bits it gets in the stock call's batched update. Only schedulers known
to be elementwise and free of random draws are stepped so (:data:`KNOWN`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KNOWN", "Schedule", "refusal"]

# Schedulers whose step is elementwise, deterministic and keeps its state in its own instance.
KNOWN = ("FlowMatchEulerDiscreteScheduler",)


def refusal(scheduler: Any) -> str | None:
    """Why ``scheduler`` cannot be stepped per row (None: it can)."""
    name = type(scheduler).__name__
    if name not in KNOWN:
        return f"{name} is not stepped per row (known: {', '.join(KNOWN)})"
    if getattr(scheduler, "config", {}).get("stochastic_sampling", False):
        return f"{name} with stochastic_sampling draws noise at every step from no generator of the request's"
    return None


class Schedule:
    """One row's scheduler (its timesteps set, its begin index 0) and the step the row is at."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.timesteps = scheduler.timesteps
        self.index = 0

    @property
    def steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.index >= self.steps

    @property
    def timestep(self) -> torch.Tensor:
        """The row's timestep now (a 0-d tensor on the device: no host sync)."""
        return self.timesteps[self.index]

    def step(self, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """The scheduler's update of ``sample`` (the row's latents) by ``model_output``; the row moves on one step."""
        out = self.scheduler.step(model_output, self.timestep, sample, return_dict=False)[0]
        self.index += 1
        return out

    def x0(self, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """The model's estimate of the clean latents at this step (before :meth:`step`): flow
        matching's ``x_t - sigma_t * v``, in float32. For a preview only: nothing else reads it."""
        sigma = self.scheduler.sigmas[self.index]
        return sample.float() - sigma * model_output.float()
