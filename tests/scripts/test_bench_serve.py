"""scripts/bench_serve.py at its smallest on the CPU (the tiny model): bcg-serve's flags pass
through, and the pipeline's own rate, each bucket's call, the loop, the batched and the unbatched
server runs (with the split of their latency into queue, device, encode and the rest), the
ratios, the table and the JSON are written (speed is reported, never asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.ranks import ROOT
from tests.pipelines.serve.server import make_lora

sys.path.insert(0, str(ROOT / "scripts"))
import bench_serve


def test_a_tiny_run_writes_every_variant(tmp_path: Path, few_threads: None) -> None:
    out = tmp_path / "serve"
    argv = ["--resolutions", "32x32", "--batch-sizes", "1", "2", "4", "--steps", "1", "--requests", "8",
            "--clients", "1", "4", "--repeats", "1", "--pipeline-calls", "2"]  # fmt: skip
    assert bench_serve.main([*argv, "--out", str(out), "--device", "cpu"]) == 0
    result = json.loads((out / "serve.json").read_text())
    rows = {(r["variant"], r["clients"], r.get("batch")): r for r in result["rows"]}
    assert sorted(rows) == [("batched", 1, None), ("batched", 4, None), ("bucket", 1, 1), ("bucket", 1, 2),
                            ("bucket", 1, 4), ("continuous", 1, None), ("continuous", 4, None), ("loop", 1, None),
                            ("pipeline", 1, None), ("unbatched", 1, None), ("unbatched", 4, None)]  # fmt: skip
    for (variant, _, batch), r in rows.items():
        assert r["images_per_s"] > 0 and 0 < r["p50_ms"] <= r["p95_ms"]
        expected = {"pipeline": 2, "bucket": batch}.get(variant, 8)
        assert r["images"] == expected, (variant, r)
    for key, r in rows.items():  # the server runs split a request's mean latency; the others have no split
        parts = [r.get(k) for k in ("queue_ms", "device_ms", "encode_ms", "rest_ms")]
        if key[0] not in ("batched", "unbatched", "continuous"):
            assert parts == [None] * 4, (key, r)
            continue
        assert all(p >= 0 for p in parts) and r["device_ms"] > 0 and r["encode_ms"] > 0, (key, r)
        assert sum(parts[:3]) <= r["mean_ms"] and abs(sum(parts) - r["mean_ms"]) < 0.1, (key, r)
        assert sum(parts[:3]) <= r["server_ms"] + 0.03 and r["server_ms"] <= r["mean_ms"], (key, r)  # rounding
    assert rows[("unbatched", 4, None)]["requests_per_call"] == 1.0  # calls of one image: never joined
    assert 1.0 <= rows[("batched", 4, None)]["requests_per_call"] <= 4.0
    for key in (("batched", 4, None), ("unbatched", 4, None)):  # every request's image, call by call
        r = rows[key]
        assert sum(r["call_images"]) == r["images"] and len(r["call_images"]) * r["requests_per_call"] == pytest.approx(
            r["images"], abs=0.01
        )
    assert set(rows[("unbatched", 4, None)]["call_images"]) == {1}
    for key in (("batched", 4, None), ("unbatched", 4, None)):  # the calls, as /metrics counted them
        r = rows[key]
        assert r["runs"] == len(r["call_images"]), r
        assert r["rows_mean"] == pytest.approx(sum(r["call_images"]) / len(r["call_images"]), abs=0.01), r
        assert r["rows_mean"] <= r["bucket_mean"] <= 4, r
    assert rows[("unbatched", 4, None)]["bucket_mean"] == 1.0
    ratios = result["ratios"]
    assert {"batched_over_unbatched_4_clients", "batched_4_over_pipeline_images_per_s",
            "batched_1_p50_over_pipeline_p50"} <= set(ratios)  # fmt: skip
    assert result["settings"]["resolution"] == "32x32" and result["settings"]["batch_sizes"] == [1, 2, 4]
    assert result["env"]["torch"] and result["build_seconds"] > 0
    table = (out / "serve.md").read_text()
    assert (
        "| batched | 4 | 4 |" in table and "| pipeline | 1 |" in table and "batched_over_unbatched_4_clients" in table
    )
    assert "| rows / bucket | mean ms | queue ms | device ms | encode ms | rest ms |" in table
    b4 = rows[("batched", 4, None)]
    assert f"| {b4['mean_ms']:.1f} | {b4['queue_ms']:.1f} | {b4['device_ms']:.1f} | {b4['encode_ms']:.1f} | " in table
    assert f"batched at 4 client(s): {' '.join(map(str, b4['call_images']))}" in table


def test_a_lora_is_named_by_every_request_and_variants_can_be_picked(tmp_path: Path, few_threads: None) -> None:
    lora = make_lora(tmp_path)
    out = tmp_path / "serve"
    argv = ["--resolutions", "32x32", "--steps", "1", "--requests", "4", "--clients", "2", "--repeats", "1",
            "--pipeline-calls", "1", "--variants", "pipeline", "batched", "--lora", f"style={lora}"]  # fmt: skip
    assert bench_serve.main([*argv, "--out", str(out), "--device", "cpu"]) == 0
    result = json.loads((out / "serve.json").read_text())
    assert sorted((r["variant"], r["clients"]) for r in result["rows"]) == [("batched", 2), ("pipeline", 1)]
    assert result["settings"]["lora"] == "style" and list(result["ratios"]) == ["batched_2_over_pipeline_images_per_s"]


@pytest.mark.parametrize(
    "argv, says",
    [(["--batch-sizes", "0"], "--batch-sizes: must be at least 1"), (["--quantize", "fp8"], "--quantize fp8")],
)
def test_bad_flags_are_one_line_and_status_2(argv: list[str], says: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert bench_serve.main([*argv, "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_the_clients_process_tells_a_failure_in_one_line() -> None:
    """The load runs in a process of its own; a server it cannot reach ends the run, named."""
    import socket

    from benchkit.serve_runs import clients_process

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match=r"^the clients failed: ConnectError") as e:
        clients_process(port, 2, [{"prompt": "a"}, {"prompt": "b"}])
    assert "\n" not in str(e.value)


def test_continuous_and_open_loop_arrivals_run_side_by_side(tmp_path: Path, few_threads: None) -> None:
    """``continuous`` is the same warm engine behind ``--batching continuous``; ``--arrival-rate
    0.5x`` sends Poisson arrivals at half the batched server's measured images/s, to both servers,
    bounded by --requests; p99 and the continuous-over-batched ratios are written."""
    out = tmp_path / "serve"
    argv = ["--resolutions", "32x32", "--batch-sizes", "1", "2", "--steps", "1", "--requests", "6", "--clients", "2",
            "--repeats", "1", "--variants", "batched", "continuous", "--arrival-rate", "0.5x", "40",
            "--arrival-seconds", "30"]  # fmt: skip
    assert bench_serve.main([*argv, "--out", str(out), "--device", "cpu"]) == 0
    result = json.loads((out / "serve.json").read_text())
    rows = {(r["variant"], r["clients"], r.get("arrival_rate")): r for r in result["rows"]}
    batched = rows[("batched", 2, None)]
    slow = round(0.5 * batched["images_per_s"], 3)
    assert result["settings"]["arrival_rates"] == [slow, 40.0]
    assert sorted(rows) == sorted([("batched", 2, None), ("continuous", 2, None), ("batched", 0, slow),
                                   ("batched", 0, 40.0), ("continuous", 0, slow), ("continuous", 0, 40.0)])  # fmt: skip
    for r in rows.values():
        assert r["images"] == 6 and 0 < r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"], r
    assert rows[("continuous", 2, None)]["requests_per_call"] is None  # no pipeline calls: steps
    for key in (k for k in rows if k[0] == "continuous"):  # its steps: 6 one-step requests, rows of at most 2
        r = rows[key]
        assert 3 <= r["runs"] <= 6 and 1.0 <= r["rows_mean"] <= r["bucket_mean"] <= 2.0, r
        assert r["runs"] * r["rows_mean"] == pytest.approx(6, abs=0.05), r  # each request's one step, once
    ratios = result["ratios"]
    assert {"continuous_over_batched_2_clients", f"continuous_over_batched_p50_at_{slow:g}_per_s",
            "continuous_over_batched_p99_at_40_per_s"} <= set(ratios)  # fmt: skip
    assert "| continuous | open, 40/s |" in (out / "serve.md").read_text()


def test_the_open_loop_client_sends_to_loopback_only() -> None:
    import contextlib
    import io

    from benchkit.serve_client import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["http://example.com:80", "--rate", "1", "--seconds", "1", "--seed", "0"]) == 0
    assert "loopback address only" in json.loads(printed.getvalue())["error"]
