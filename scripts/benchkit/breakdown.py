"""Where one pipeline call spends its time: the typed result (:class:`Breakdown`).

Pure data, no torch, no other module of benchkit: :mod:`benchkit.rows` stores a breakdown on a
row, :mod:`benchkit.breakdown_table` writes its table, :mod:`benchkit.phases` measures it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# (key, table heading, what it is); disjoint, in call order; together with "other" they are the call.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("text_encoder", "text encoder", "the text encoder's forward calls (all of them: true CFG encodes twice)"),
    ("prompt_rest", "rest of encode_prompt", "encode_prompt outside the text encoder: tokenizing, picking states"),
    ("denoiser", "denoiser", "the denoiser's forward calls"),
    ("loop_rest", "rest of the loop", "the denoising loop outside the denoiser: scheduler, guidance, callbacks"),
    ("vae_decode", "VAE decode", "vae.decode"),
    ("postprocess", "post-processing", "image_processor.postprocess (to PIL)"),
    ("other", "other", "the rest of the call (latents and timesteps set-up, latent scaling)"),
)
PHASE_KEYS = tuple(key for key, _, _ in PHASES)
CLOCKS = {"cuda": "cuda events", "host": "host clock"}


@dataclasses.dataclass
class Phase:
    ms: float
    share: float  # of the call
    calls: int | None = None  # calls the phase is made of (None: a remainder, not calls)


@dataclasses.dataclass
class Breakdown:
    """One end-to-end call split into :data:`PHASES` (JSON key ``e2e_breakdown`` of a row)."""

    clock: str  # "cuda events" (one synchronize after the call) or "host clock" (CPU)
    call_ms: float  # the call, first mark to last, on that clock
    wall_ms: float  # host wall time of the same call, device synchronized before and after
    phases: dict[str, Phase]  # every key of PHASE_KEYS, in that order
    denoiser_ms: float
    outside_denoiser_ms: float  # call_ms - denoiser_ms
    outside_denoiser_share: float
    loop: str = "progress bar"  # how the denoising loop was bracketed
    runs: int = 1
    notes: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Breakdown:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["phases"] = {k: Phase(**v) for k, v in data.get("phases", {}).items()}
        return cls(**values)

    def ms(self, key: str) -> float:
        phase = self.phases.get(key)
        return 0.0 if phase is None else phase.ms

    def line(self) -> str:
        """The progress line."""
        parts = [f"{label} {self.ms(key):.1f}" for key, label, _ in PHASES]
        return (
            f"call {self.call_ms:.1f} ms ({self.clock}): " + ", ".join(parts) + f"; outside the denoiser "
            f"{self.outside_denoiser_ms:.1f} ms ({self.outside_denoiser_share:.0%})"
        )
