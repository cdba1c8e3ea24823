"""jax_seqpar.tools.bench (measured, on 8 emulated CPU devices) and
jax_seqpar.planning.projection (the planner's time model on large meshes).

The bench runs are tiny (S=256) so this file stays fast: one run of every strategy
(Ulysses, ring, all-gather over 8 devices, the hybrid as a ring of 4 x Ulysses of 2,
where XLA sends exactly the modelled bytes), one CLI run writing JSON and PNG, and
the skip / error paths, which compile nothing.
"""

import argparse
import json

import pytest

from jax_seqpar import comm_bytes
from jax_seqpar.core.layout import LAYOUTS
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.planning import hardware, predict, projection
from jax_seqpar.planning.plan import plan
from jax_seqpar.tools import bench, bench_report, report

TINY = LayerShape(batch=1, seq_len=256, num_heads=8, num_kv_heads=2, head_dim=16,
                  dtype="float32", causal=True)
DEFAULT = bench.DEFAULT_SHAPE  # B=1, S=4096, H=8, Hkv=2, D=64, float32, causal


@pytest.fixture(scope="module")
def tiny_result():
    return bench.run(TINY, ["sp=8", "outer=4,inner=2"], warmup=0, runs=1, progress=False)


def test_run_measures_every_strategy(tiny_result):
    rows = {(r["strategy"], r["mesh"]): r for r in tiny_result["rows"]}
    assert set(rows) == {("ulysses", "sp=8"), ("ring", "sp=8"), ("allgather", "sp=8"),
                         ("hybrid", "outer=4,inner=2")}
    for row in rows.values():
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0, row
        assert row["temp_fwd_bwd_bytes"] >= row["temp_fwd_bytes"] > 0, row
        # The model is exact for these programs (rings of 4 and 8, float32).
        assert row["hlo_fwd_bytes"] == pytest.approx(row["model_fwd_bytes"], rel=0.01), row
        assert row["hlo_fwd_bwd_bytes"] == pytest.approx(row["model_fwd_bwd_bytes"],
                                                         rel=0.01), row
        assert row["err_out"] < 1e-4 and row["err_grad"] < 1e-4, row
    assert rows[("ring", "sp=8")]["model_fwd_bytes"] == comm_bytes(
        "ring", axis_sizes=8, **TINY.replace(backward=False).comm_kwargs())
    assert rows[("ring", "sp=8")]["layout"] == "zigzag"  # causal ring: balanced order
    assert rows[("ulysses", "sp=8")]["layout"] == "contiguous"


def test_run_reports_plan_and_skips(tiny_result):
    plans = {p["mesh"]: p for p in tiny_result["plans"]}
    assert plans["sp=8"]["strategy"] == plan(256, 8, 2, 16, {"sp": 8}).strategy
    assert plans["outer=4,inner=2"]["strategy"] == plan(
        256, 8, 2, 16, {"outer": 4, "inner": 2}).strategy
    planned = [r for r in tiny_result["rows"] if r["planned"]]
    assert {(r["strategy"], r["mesh"]) for r in planned} <= {
        (p["strategy"], p["mesh"]) for p in tiny_result["plans"]}
    skipped = {(s["strategy"], s["mesh"]): s["reason"] for s in tiny_result["skipped"]}
    assert "hybrid needs a two-axis mesh" in skipped[("hybrid", "sp=8")]
    assert "8-device one-axis run" in skipped[("ring", "outer=4,inner=2")]
    table = bench_report.format_table(tiny_result)
    assert "HLO/model" in table and "plan.plan's choice" in table
    assert all(r["strategy"] in table for r in tiny_result["rows"])


def _parse(argv):
    return bench_report.add_bench_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_cli_writes_json_and_png(tmp_path, capsys):
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    args = _parse(["--seq", "32,64", "--heads", "4", "--kv-heads", "4", "--head-dim", "8",
                   "--mesh", "sp=4", "--strategies", "ring,ulysses", "--warmup", "0", "--runs",
                   "1", "--no-progress", "--json", str(json_path), "--plot", str(png_path)])
    assert bench_report.run_bench(args) == 0
    printed = capsys.readouterr().out
    assert "ring" in printed and "ulysses" in printed
    result = json.loads(json_path.read_text())
    assert {(r["strategy"], r["seq_len"]) for r in result["rows"]} == {
        ("ring", 32), ("ring", 64), ("ulysses", 32), ("ulysses", 64)}
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_option_is_documented():
    parser = bench_report.add_bench_arguments(argparse.ArgumentParser())
    for action in parser._actions:
        assert action.help, action.option_strings


@pytest.mark.parametrize("shape, meshes, strategies, message", [
    pytest.param(DEFAULT.replace(seq_len=256, num_heads=12, num_kv_heads=4), ["sp=8"],
                 ["ulysses"], "num_heads=12 is not divisible by the ulysses axis size 8",
                 id="ulysses_heads"),
    pytest.param(TINY, ["sp=8"], ["hybrid"], "hybrid needs a two-axis mesh", id="hybrid_1_axis"),
    pytest.param(DEFAULT.replace(seq_len=1004), ["sp=8"], ["ring"],
                 "seq_len=1004 is not divisible by the 8 devices", id="seq_not_divisible"),
    pytest.param(DEFAULT.replace(seq_len=8 * 3), ["sp=8"], ["ring"],
                 "not divisible by 2\\*8=16 zigzag half-shards", id="zigzag_chunks"),
    pytest.param(DEFAULT.replace(seq_len=288, num_heads=8, num_kv_heads=8),
                 ["dcn=2,ici=3"], ["hybrid"],
                 "num_heads=8 is not divisible by the ulysses \\(inner\\) axis size 3",
                 id="hybrid_inner"),
    pytest.param(TINY, ["sp=16"], ["ring"], "needs 16 devices but JAX has 8", id="devices"),
    pytest.param(TINY, ["sp=8"], ["tree"], "strategy names must be some of", id="strategy"),
    pytest.param(TINY, ["sp=8,a=1,b=1"], ["ring"], "has 3 axes", id="three_axes"),
    pytest.param(TINY, ["sp=0"], ["ring"], "distinct name=size pairs", id="bad_mesh"),
    pytest.param(TINY.replace(dtype="float64"), ["sp=8"], ["ring"],
                 "the bench runs dtype one of", id="dtype"),
    pytest.param(TINY.replace(window=16), ["sp=8"], ["ring"],
                 "the bench runs full or causal masks", id="window"),
])
def test_impossible_combinations_raise(shape, meshes, strategies, message):
    with pytest.raises(ValueError, match=message):
        bench.run(shape, meshes, strategies=strategies, progress=False)


def test_cli_error_is_a_message_and_status_2(capsys):
    args = _parse(["--seq", "256", "--heads", "12", "--kv-heads", "4", "--mesh", "sp=8",
                   "--strategies", "ulysses", "--no-progress"])
    assert bench_report.run_bench(args) == 2
    assert "num_heads=12 is not divisible by the ulysses axis size 8" in capsys.readouterr().err


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype='int8' is not a floating-point dtype"):
        TINY.replace(dtype="int8")


# --- projection (the planner's time model: no devices) ----------------------------

GQA = dict(num_heads=64, num_kv_heads=8, head_dim=128)
MLA = dict(num_heads=128, num_kv_heads=1, head_dim=576, v_head_dim=512)
SEQS = (32768, 131072, 1048576)


@pytest.mark.parametrize("shape", [GQA, MLA], ids=["gqa", "mla"])
def test_projection_grows_with_sequence(shape):
    rows = projection.project(**shape, chips=(8, 64, 1024), seq_lens=SEQS)
    by_key = {(r["chips"], r["strategy"], r["seq_len"]): r for r in rows}
    for (chips, strategy, seq), row in by_key.items():
        if row["comm_ms"] is None or seq == SEQS[-1]:
            continue
        longer = by_key[(chips, strategy, SEQS[SEQS.index(seq) + 1])]
        assert longer["bytes_per_device"] > row["bytes_per_device"]
        assert longer["comm_ms"] > row["comm_ms"]
        assert longer["compute_ms"] > row["compute_ms"]
        assert row["ici_bytes"] + row["dcn_bytes"] == pytest.approx(row["bytes_per_device"])


def test_projection_rows_are_predict_breakdowns():
    """One model: every number of a row is predict's, on nodes of 8 H100s."""
    rows = projection.project(**GQA, chips=(8, 64), seq_lens=(32768,))
    model = hardware.H100.replace(devices_per_domain=8)
    for row in rows:
        strategy = row["strategy"]
        factors = (row["outer"], row["inner"]) if strategy == "hybrid" else (
            (1, row["chips"]) if strategy == "ulysses" else (row["chips"], 1))
        layer = LayerShape(1, 32768, causal=True, **GQA)
        result = predict.predict(predict.Candidate(strategy, *factors), layer, model)
        assert row["predicted_ms"] == pytest.approx(result["seconds"] * 1e3), strategy
        assert row["comm_ms"] == pytest.approx(result["comm_seconds"] * 1e3), strategy
        assert row["compute_ms"] == pytest.approx(result["compute_seconds"] * 1e3), strategy
        assert (row["ici_bytes"], row["dcn_bytes"]) == (result["ici_bytes"],
                                                        result["dcn_bytes"])
        assert row["predicted_ms"] >= row["compute_ms"]
        assert row["comm_ms"] * (1 + 1e-12) >= row["exposed_comm_ms"] >= 0
    within_a_node = [r for r in rows if r["chips"] == 8]
    assert all(r["dcn_bytes"] == 0 for r in within_a_node)
    assert all(r["dcn_bytes"] > 0 for r in rows if r["chips"] == 64)


def test_projection_bytes_are_comm_bytes_and_plan_is_marked():
    rows = projection.project(**GQA, chips=(8, 256), seq_lens=(131072,))
    for row in rows:
        sizes = (row["outer"], row["inner"]) if row["strategy"] == "hybrid" else row["chips"]
        if row["comm_ms"] is None:
            assert "not divisible" in row["reason"]  # ulysses: 64 heads on 256 chips
            continue
        assert row["bytes_per_device"] == pytest.approx(comm_bytes(
            row["strategy"], batch=1, seq_len=131072, axis_sizes=sizes, backward=True, **GQA))
    for chips, mesh in ((8, {"ici": 8}), (256, {"dcn": 32, "ici": 8})):
        planned = [r["strategy"] for r in rows if r["chips"] == chips and r["planned"]]
        assert planned == [plan(131072, 64, 8, 128, mesh).strategy]


def test_projection_hardware_is_overridable():
    h100 = hardware.H100
    fast = h100.replace(dcn=hardware.Link(bandwidth=2 * h100.dcn.bandwidth,
                                          latency=h100.dcn.latency))
    slow_rows = projection.project(**GQA, chips=(64,), seq_lens=(131072,))
    fast_rows = projection.project(**GQA, chips=(64,), seq_lens=(131072,), hardware=fast)
    for slow, quick in zip(slow_rows, fast_rows):
        assert quick["comm_ms"] < slow["comm_ms"], slow["strategy"]
        assert quick["compute_ms"] == slow["compute_ms"]
    one_domain = projection.project(**GQA, chips=(64,), seq_lens=(131072,), hardware="tpu-v5p")
    assert {r["strategy"] for r in one_domain} == {"ulysses", "ring", "allgather"}
    assert all(r["dcn_bytes"] == 0 for r in one_domain)


def test_projection_table_and_errors(capsys):
    table = report.format_projection(projection.project(**MLA, chips=(8, 1024), seq_lens=SEQS))
    assert table.startswith("MODEL")
    assert len(table.splitlines()) == 3 + 2 * len(SEQS)  # title, header, rule, rows
    with pytest.raises(ValueError, match="chips=12 is not a whole number of 8-chip nodes"):
        projection.project(**GQA, chips=(12,))
    with pytest.raises(ValueError, match="chips_per_node must be a positive int"):
        projection.project(**GQA, chips_per_node=0)
    assert bench_report.run_bench(_parse(["--project", "--heads", "64", "--kv-heads", "8",
                                   "--head-dim", "128"])) == 0
    assert "MODEL" in capsys.readouterr().out


def test_packed_balance_table_and_plot(tmp_path):
    """``bench --packed``'s numbers at a small size (no timing): per_document's token work
    is balanced on every mix, the table names every layout, the plot is written."""
    from jax_seqpar.tools import packed_bench

    shape = LayerShape(1, 2048, 2, 1, 32, causal=True)
    result = packed_bench.run_packed(shape, 4, seeds=1, time_ring=False)
    per_document = [r for r in result["balance"] if r["layout"] == "per_document"]
    assert len(per_document) == 3
    assert all(r["tokens"]["worst"] <= 1.05 for r in per_document)
    text = packed_bench.format_packed(result)
    assert all(name in text for name in LAYOUTS)
    packed_bench.plot_packed(result, str(tmp_path / "packed.png"))
    assert (tmp_path / "packed.png").read_bytes()[:4] == b"\x89PNG"
    parser = bench_report.add_bench_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--packed", "--seeds", "2"]).packed
