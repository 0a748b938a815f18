"""Which sizes keep the VAE decoder's graphs: the rule the warm-up's trial applies to what it measured.

A size's graphs are kept only where they pay, in time or in memory:

* **Time.** The replay is *faster* where it beats the eager decode by more than the margin (the
  larger of one timed call's noise, taken as the spread of the timed runs of either, and
  :data:`MIN_GAIN` of the eager time), *slower* where it loses by more than that, a *tie*
  otherwise. A slower size never keeps its graphs.
* **Memory.** Graph memory is resident, and an eager decode's transient cannot use the graph
  pool's blocks: it comes on top of the pool. Graphs of one pool share its blocks (only one
  replays at a time), so with the sizes ``K`` kept the process holds, above its weights, about

      peak(K) = max(pool, max over K of a graph's pool bytes) + the kept graphs' own buffers
                + max(the largest replay's copies out over K, the largest eager transient outside K)

  where ``pool`` is what the shared pool holds already (the denoisers' and text encoders'
  graphs). Decoding eagerly everywhere is ``peak(∅) = pool + the largest eager transient``.

Among the sets of sizes that are not slower, the one kept is the one that saves the most decode
time (the faster sizes' gains) without an estimated peak above ``peak(∅)`` but for the kept
graphs' own buffers (their static inputs and output, about an image's bytes each: what any graph
costs); between equal savings the lower peak, then fewer graphs. So a tie keeps its graphs where
they lower the peak (the largest decode's graphs replace the largest transient the pipeline has,
and the denoiser's graphs reuse their blocks), and a faster size gives its graphs up where keeping
them would cost memory: graphs kept at the largest size beside an eager decode at the next one
hold both. On an H100 (samples/gpu-run-2026-12-06e/memory/), Z-Image compiled at 1536x864,
1024x1024 and 512x512 kept the decoder's graphs at 1536x864 (a tie, 73.2 against 73.4 ms) and
decoded 1024x1024 eagerly (a tie too, 55.0 against 55.0): its peak rose at the 1024x1024 call to
30.1 GiB, 1.166x eager's, where the same warm-up without compile kept every size's graphs and
stayed at 26.1 GiB, 1.01x.
Sizes an earlier warm-up decided keep their verdict and enter the estimate as they are.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable, Sequence

__all__ = ["MAX_EXACT", "MIN_GAIN", "NOT_KEPT", "Timing", "choose", "estimated_peak"]

# The start of the reason a size decoded eagerly is refused with (report() says it apart from failures).
NOT_KEPT = "graphs not kept:"
# The least gain (a share of the eager decode's time) that counts as faster, whatever the noise.
MIN_GAIN = 0.01
# Sizes chosen among by trying every set of them (the largest gains); any beyond are kept only
# where faster and within the peak, one by one, largest gain first.
MAX_EXACT = 12

Size = tuple[int, int, int | None]


@dataclasses.dataclass
class Timing:
    """One decoder call signature at one warm-up size: what its trial measured, and the verdict.

    ``noise_ms``: the larger spread of the timed runs (replay or eager); ``graph_bytes``: what its
    graphs held in a pool of their own; ``held_bytes``: their buffers outside any pool (static
    inputs, break boundaries); ``replay_bytes``: the most a replay allocated outside the pool (its
    output and stored tensors copied out); ``eager_bytes``: the most an eager decode allocated above
    what was allocated before it. ``kept`` is None until :func:`choose` decides; ``why`` says why
    not kept."""

    size: Size
    key: Hashable
    graph_ms: float
    eager_ms: float
    noise_ms: float = 0.0
    graph_bytes: int = 0
    held_bytes: int = 0
    replay_bytes: int = 0
    eager_bytes: int = 0
    kept: bool | None = None
    why: str = ""

    @property
    def margin_ms(self) -> float:
        return max(self.noise_ms, MIN_GAIN * self.eager_ms)

    @property
    def pace(self) -> str:
        """``"faster"``, ``"slower"`` or ``"tie"`` (see the module docstring)."""
        if self.eager_ms - self.graph_ms > self.margin_ms:
            return "faster"
        if self.graph_ms - self.eager_ms > self.margin_ms:
            return "slower"
        return "tie"

    @property
    def gain_ms(self) -> float:
        """The decode time its graphs save (0 unless faster)."""
        return self.eager_ms - self.graph_ms if self.pace == "faster" else 0.0

    @property
    def label(self) -> str:
        w, h, frames = self.size
        return f"{w}x{h}" + (f", {frames} frames" if frames is not None else "")

    @property
    def verdict(self) -> str:
        """In a word or two: ``graphs`` (faster), ``graphs: peak`` (kept for the peak memory),
        ``eager: slower``, ``eager: tie``, ``eager: peak`` (faster, but it would raise the peak),
        ``undecided``."""
        if self.kept is None:
            return "undecided"
        if self.kept:
            return "graphs" if self.pace == "faster" else "graphs: peak"
        return {"slower": "eager: slower", "tie": "eager: tie"}.get(self.pace, "eager: peak")

    def times(self) -> str:
        return f"{self.graph_ms:.1f} ms against {self.eager_ms:.1f} ms eager, noise {self.margin_ms:.1f} ms"

    def memory(self) -> str:
        return (
            f"graphs {(self.graph_bytes + self.held_bytes) / 2**20:.0f} MiB, "
            f"eager decode {self.eager_bytes / 2**20:.0f} MiB"
        )

    def reason(self) -> str:
        return f"{NOT_KEPT} at {self.label}, {self.why} ({self.times()}; {self.memory()})"


def estimated_peak(kept: Sequence[Timing], eager: Sequence[Timing], pool_bytes: int) -> int:
    """The bytes held above the weights with ``kept``'s graphs in a pool holding ``pool_bytes``
    and ``eager`` decoded eagerly (see the module docstring)."""
    pool = max([pool_bytes, *(t.graph_bytes for t in kept)])
    transient = max([0, *(t.replay_bytes for t in kept), *(t.eager_bytes for t in eager)])
    return pool + sum(t.held_bytes for t in kept) + transient


def choose(new: Sequence[Timing], earlier: Sequence[Timing], pool_bytes: int) -> None:
    """Decide ``new`` (``kept`` and ``why``), with ``earlier``'s verdicts as they are and the
    shared pool holding ``pool_bytes`` (earlier kept sizes' graphs in it already)."""
    fixed_kept = [dataclasses.replace(t, graph_bytes=0) for t in earlier if t.kept]
    fixed_eager = [t for t in earlier if not t.kept]
    candidates = sorted((t for t in new if t.pace != "slower"), key=lambda t: t.gain_ms, reverse=True)
    exact, rest = candidates[:MAX_EXACT], candidates[MAX_EXACT:]

    def score(kept: Sequence[Timing]) -> tuple[float, int, int]:
        ids = {id(t) for t in kept}
        eager = [t for t in new if id(t) not in ids]
        peak = estimated_peak([*fixed_kept, *kept], [*fixed_eager, *eager], pool_bytes)
        return (-sum(t.gain_ms for t in kept), peak, len(kept))

    def allowed(kept: Sequence[Timing], score: tuple[float, int, int]) -> bool:
        return score[1] - sum(t.held_bytes for t in kept) <= limit

    limit = estimated_peak(fixed_kept, [*fixed_eager, *new], pool_bytes)
    best: list[Timing] = []
    best_score = score(best)
    for n in range(1, len(exact) + 1):
        for kept in itertools.combinations(exact, n):
            s = score(kept)
            if allowed(kept, s) and s < best_score:
                best, best_score = list(kept), s
    for t in rest:  # beyond MAX_EXACT sizes: kept where faster and within the limit, largest gain first
        if t.pace == "faster" and allowed([*best, t], score([*best, t])):
            best.append(t)
    chosen = {id(t) for t in best}
    for t in new:
        t.kept = id(t) in chosen
        if t.kept:
            t.why = ""
        elif t.pace == "slower":
            t.why = "the replay was slower than the eager decode"
        elif t.pace == "tie":
            t.why = "the replay was no faster than the eager decode beyond its noise, and its graphs lower no peak"
        else:
            t.why = "its graphs would raise the estimated peak memory above decoding eagerly"
