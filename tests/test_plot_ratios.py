"""`benchmarks/compare/plot.py` reads both line formats into the same ratios (fast tier: no engine)."""

from __future__ import annotations

import json

import pytest

from benchmarks.compare.plot import RATIOS, figures, parse_call, ratios


def _write(path, lines):
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nINFO a log line the reader skips\n")
    return path


def test_p1_stacks_lines_give_768_over_the_median_and_the_decode_tag_picks_its_run(tmp_path):
    f = _write(tmp_path / "call.jsonl", [
        {"call": "a header line"},
        *({"bench": "p1", "engine": "stock", "variant": "stock", "seconds": s} for s in (0.2, 0.1, 0.4)),
        *({"bench": "p1", "engine": "cb", "variant": "sweep_http", "seconds": s} for s in (0.4, 0.3, 0.9)),
        {"bench": "p1_sampled", "variant": "sweep_http", "seconds": 9.0},  # sampled repetitions are not timed ones
        {"bench": "S", "task": "p2", "batch": 32, "out_tok_per_s": 1000.0},
        {"bench": "CB_p2", "batch": 32, "variant": "vanilla", "tok_s": 900.0},
        {"bench": "CBmerged_p2", "batch": 32, "variant": "vanilla", "tok_s": 990.0},
        {"bench": "CBnoops_p2", "batch": 32, "variant": "vanilla", "tok_s": 1010.0},
    ])
    fig = figures(f, "CBmerged")
    assert fig["stock P1"] == pytest.approx(768 / 0.2)
    assert fig["cb P1 http"] == pytest.approx(768 / 0.4)
    by_label = dict(zip((r[0] for r in RATIOS), ratios(fig)))
    assert by_label["P1 768-cell sweep over HTTP"] == pytest.approx(0.5)
    assert by_label["P2 decode b32"] == pytest.approx(0.99)
    assert by_label["P1 768 patched cells (engine)"] == 0.0  # not in this call: no bar
    assert ratios(figures(f, "CB"))[0] == pytest.approx(0.9)
    assert ratios(figures(f))[0] == pytest.approx(1.01)  # no tag: the last CB* run


def test_harness_lines_and_the_call_argument(tmp_path):
    f = _write(tmp_path / "h.jsonl", [
        {"bench": "S_stock", "task": "p1", "req_per_s": 2000.0},
        {"bench": "CB_bi_off_p1", "variant": "engine_patched_768", "cells_per_s": 1000.0},
        {"bench": "CB_bi_off_p1http", "cells_per_s": 500.0},
    ])
    by_label = dict(zip((r[0] for r in RATIOS), ratios(figures(f))))
    assert by_label["P1 768 patched cells (engine)"] == pytest.approx(0.5)
    assert by_label["P1 768-cell sweep over HTTP"] == pytest.approx(0.25)
    assert parse_call(f"2026-11-27, H200={f}@CBmerged") == ("2026-11-27, H200", f, "CBmerged")
    assert parse_call(f"x={f}") == ("x", f, None)
    with pytest.raises(SystemExit, match="LABEL=FILE"):
        parse_call(str(f))


def test_absolute_figures_read_stock_both_causalboard_tags_and_hf_and_draw(tmp_path):
    """`--absolute`: one call's throughputs by workload — stock, causalboard with batch invariance
    off and on (their run_compare.sh tags), HF hooks' variants — and the figure is written."""
    from benchmarks.compare.plot import ABSOLUTE, absolute_figures, plot_absolute

    f = _write(tmp_path / "call.jsonl", [
        {"bench": "S_stock", "task": "p1", "req_per_s": 3000.0},
        {"bench": "S_stock", "task": "p2", "batch": 1, "out_tok_per_s": 500.0},
        {"bench": "CB_bi_off_p1", "variant": "engine_patched_768", "cells_per_s": 2500.0},
        {"bench": "CB_bi_off_p1http", "cells": 768, "cells_per_s": 2100.0},
        {"bench": "CB_bi_on_p1http", "cells": 768, "cells_per_s": 1800.0},
        {"bench": "CB_bi_on_p2", "batch": 1, "variant": "vanilla", "tok_s": 200.0},
        {"bench": "HF", "step": "variant", "variant": "batched_256", "cells_per_s": 9700.0},
        {"bench": "HF", "step": "check", "variant": "batched_256", "max_abs_diff_vs_loop": 0.05},
        {"bench": "driver", "step": "HF", "rc": 0},
    ])
    fig = absolute_figures(f)
    assert fig == {"stock P1": 3000.0, "stock P2 b1": 500.0, "CB_bi_off P1 engine_patched_768": 2500.0,
                   "CB_bi_off P1 http": 2100.0, "CB_bi_on P1 http": 1800.0, "CB_bi_on P2 b1 vanilla": 200.0,
                   "HF batched_256": 9700.0}
    assert set(fig) <= {k for _, _, k in ABSOLUTE}  # every figure read has its bar
    out = tmp_path / "abs.png"
    plot_absolute(f, out, "test")
    assert out.stat().st_size > 10_000
    with pytest.raises(SystemExit, match="none of the figures"):
        plot_absolute(_write(tmp_path / "empty.jsonl", [{"bench": "driver"}]), tmp_path / "x.png", "")
