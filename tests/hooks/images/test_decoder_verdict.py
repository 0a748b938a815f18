"""Which sizes keep the VAE decoder's graphs (accel/hooks/images/decoder_verdict.py): the rule alone,
on timings as a warm-up's trial measures them. The times of the H100 cases are the ones measured
(samples/gpu-run-2026-12-06e/memory/); the decoder's bytes per size were not measured there, so the
cases take them in proportion to the pixels (Z-Image: 6.2 GiB of graphs at 1536x864, beside a
3.0 GiB pool of the denoiser's graphs)."""

from __future__ import annotations

import pytest

from accel.hooks.images.decoder_verdict import MAX_EXACT, MIN_GAIN, NOT_KEPT, Timing, choose, estimated_peak

GiB = 2**30


def _t(w: int, h: int, graph_ms: float, eager_ms: float, pool: float = 0, eager: float = 0, **kw) -> Timing:
    """A timing at ``w``x``h``; ``pool`` and ``eager`` in GiB (the graphs' pool, the eager transient)."""
    return Timing(
        (w, h, None), (w, h), graph_ms, eager_ms, graph_bytes=int(pool * GiB), eager_bytes=int(eager * GiB), **kw
    )


def _z_image(times: dict[tuple[int, int], tuple[float, float]]) -> list[Timing]:
    """Z-Image's decoder at the bars' sizes: graphs about its eager transient, both by pixels."""
    per_pixel = 6.2 / (1536 * 864)
    return [
        _t(w, h, g, e, pool=per_pixel * w * h, eager=1.03 * per_pixel * w * h, held_bytes=8 << 20)
        for (w, h), (g, e) in times.items()
    ]


def test_faster_slower_or_a_tie_by_the_runs_spread_and_at_least_one_percent() -> None:
    assert _t(1, 1, 98.0, 100.0).pace == "faster"  # 2 ms against a margin of 1 ms (1%)
    assert _t(1, 1, 98.0, 100.0, noise_ms=2.5).pace == "tie"  # within the runs' spread
    assert _t(1, 1, 100.9, 100.0).pace == "tie" and _t(1, 1, 101.5, 100.0).pace == "slower"
    assert MIN_GAIN == 0.01 and _t(1, 1, 98.0, 100.0).gain_ms == 2.0 and _t(1, 1, 99.5, 100.0).gain_ms == 0.0


def test_z_image_compiled_on_the_h100_keeps_every_size_where_the_old_rule_split_them() -> None:
    """The H100's times (compile=True): 1536x864 73.16 / 73.43 ms, 1024x1024 54.98 / 54.96, 512x512
    13.70 / 14.07. "At least as fast" kept 1536x864 and 512x512 and decoded 1024x1024 eagerly beside
    the 1536x864 graphs: the process reached 1.166x eager's peak. Both large sizes are ties (within
    1%), and keeping them lowers the peak: every size keeps its graphs."""
    times = {(1536, 864): (73.16, 73.43), (1024, 1024): (54.98, 54.96), (512, 512): (13.70, 14.07)}
    pool = 3 * GiB
    new = _z_image(times)
    big, mid, small = new
    assert [t.pace for t in new] == ["tie", "tie", "faster"]
    old_rule = estimated_peak([big, small], [mid], pool)
    eager_everywhere = estimated_peak([], new, pool)
    assert old_rule > eager_everywhere  # the mixed verdict holds the big pool and the 1024 transient
    choose(new, [], pool)
    assert [t.kept for t in new] == [True, True, True]
    assert [t.verdict for t in new] == ["graphs: peak", "graphs: peak", "graphs"]
    kept_peak = estimated_peak(new, [], pool)
    assert kept_peak < eager_everywhere < old_rule
    print(
        f"\nestimated GiB above the weights: every size kept {kept_peak / GiB:.2f}, eager everywhere "
        f"{eager_everywhere / GiB:.2f}, the old rule's split {old_rule / GiB:.2f}"
    )


def test_a_slower_size_decodes_eagerly_and_then_the_big_tie_gives_its_graphs_up() -> None:
    """With 1024x1024 measurably slower it decodes eagerly whatever the memory; then the large tie's
    graphs would sit beside that eager decode, so they go too, and only the faster size keeps its."""
    new = _z_image({(1536, 864): (73.16, 73.43), (1024, 1024): (56.5, 54.96), (512, 512): (13.70, 14.07)})
    choose(new, [], 3 * GiB)
    assert [t.verdict for t in new] == ["eager: tie", "eager: slower", "graphs"]
    assert new[1].reason().startswith(f"{NOT_KEPT} at 1024x1024, the replay was slower than the eager decode (56.5 ms")
    said = new[0].reason()
    assert "no faster than the eager decode beyond its noise, and its graphs lower no peak (73.2 ms" in said
    assert said.endswith("noise 0.7 ms; graphs 6357 MiB, eager decode 6539 MiB)")


def test_a_faster_size_whose_graphs_would_raise_the_peak_decodes_eagerly() -> None:
    """The largest size is faster, but the next one is slower with a transient of its own: keeping
    the largest's graphs would hold them beside that eager decode, above decoding eagerly everywhere."""
    big = _t(1536, 864, 70.0, 73.0, pool=6.2, eager=6.4)
    mid = _t(1024, 1024, 57.0, 55.0, pool=4.7, eager=4.9)
    choose([big, mid], [], 3 * GiB)
    assert (big.verdict, mid.verdict) == ("eager: peak", "eager: slower")
    assert "would raise the estimated peak memory above decoding eagerly" in big.reason()
    # Where the pool is the larger already (the denoiser's graphs), the faster graphs cost nothing.
    big.kept = mid.kept = None
    choose([big, mid], [], 12 * GiB)
    assert (big.verdict, mid.verdict) == ("graphs", "eager: slower")


def test_a_replay_that_copies_out_what_it_stored_keeps_ties_eager() -> None:
    """Qwen-Image's causal decoder: each replay copies out its feature cache (2.3 GiB at 1024x1024)
    beside the graphs; the H100's times (1328: 135.0 / 134.1, 1024: 76.2 / 75.5, 512: 19.55 /
    19.81 ms) make the large sizes ties, which keep no graphs where graphs and copies together
    outweigh the eager transient they replace."""
    big = _t(1328, 1328, 134.99, 134.05, pool=7.0, eager=6.9, replay_bytes=int(3.9 * GiB))
    mid = _t(1024, 1024, 76.23, 75.53, pool=4.2, eager=4.1, replay_bytes=int(2.3 * GiB))
    small = _t(512, 512, 19.55, 19.81, pool=1.05, eager=1.0, replay_bytes=int(0.6 * GiB))
    choose([big, mid, small], [], int(1.6 * GiB))
    assert [t.verdict for t in (big, mid, small)] == ["eager: tie", "eager: tie", "graphs"]


def test_sizes_an_earlier_warm_up_decided_are_weighed_as_they_are() -> None:
    """A later warm-up's tie joins the graphs kept before (their pool holds it already) where the
    eager decode would come on top of that pool."""
    earlier = _t(1536, 864, 73.0, 73.2, pool=6.2, eager=6.4, kept=True)
    tie = _t(1024, 1024, 55.0, 55.0, pool=4.7, eager=4.9)
    choose([tie], [earlier], 6.3 * GiB)
    assert tie.verdict == "graphs: peak"
    # An earlier eager size's transient stays in the estimate: a new tie cannot lower that peak.
    earlier = _t(1536, 864, 75.0, 73.2, pool=6.2, eager=6.4, kept=False)
    tie = _t(1024, 1024, 55.0, 55.0, pool=4.7, eager=4.9)
    choose([tie], [earlier], 3 * GiB)
    assert tie.verdict == "eager: tie"


@pytest.mark.parametrize("extra", [0, 3])
def test_faster_sizes_without_memory_are_all_kept_beyond_the_exact_search(extra: int) -> None:
    new = [_t(64 * (i + 1), 64, 1.0, 2.0 + i) for i in range(MAX_EXACT + extra)]
    choose(new, [], 0)
    assert all(t.kept for t in new)
