"""`causalboard sweep` / `causalboard export` as subprocesses against the real test server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.sweep.result import SweepResult

from .conftest import REPO, free_port

EXE = Path(sys.executable).parent / "causalboard"


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CAUSALBOARD_URL", "CAUSALBOARD_API_KEY")}
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _pair(tasks) -> dict:
    return next(p for p in tasks["pairs"] if p["equal_length"])


def _sweep_args(server_url: str, tasks) -> list[str]:
    pair = _pair(tasks)
    return ["sweep", "--url", server_url, "--prompt", pair["corrupt_prompt"], "--clean-prompt", pair["clean_prompt"],
            "--answer-id", str(pair["answer_id"]), "--foil-id", str(pair["foil_id"]), "--metric", "recovered",
            "--layers", "0:6:2", "--subject", pair["subject_corrupt"]]


@pytest.fixture(scope="module")
def saved_sweep(server_url, tasks, tmp_path_factory):
    """One CLI sweep saved as .npz and drawn as a figure."""
    out = tmp_path_factory.mktemp("cli")
    args = [*_sweep_args(server_url, tasks), "--out", str(out / "x.npz"), "--figure", str(out / "x.png")]
    proc = run_cli(*args)
    return proc, out


def test_sweep_writes_result_and_prints_summary(saved_sweep, tasks, engine):
    proc, out = saved_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = SweepResult.load(out / "x.npz")
    pair = _pair(tasks)
    assert res.layers == [0, 2, 4] and res.metric == "recovered"
    assert res.positions == list(range(len(engine.tokenize(pair["corrupt_prompt"]))))
    assert not np.isnan(res.to_numpy()).any()
    # stdout: the header, baselines with the noise floor, the top cells with token strings
    text = proc.stdout
    assert "metric recovered" in text and "noise floor" in text and "top cells:" in text
    best = res.top(1)[0]
    assert f"L{best['layer']} pos {best['position']} {best['token']!r}" in text
    assert "sweep" in proc.stderr and "cell" in proc.stderr  # the progress bar went to stderr


def test_sweep_figure(saved_sweep):
    proc, out = saved_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_command(saved_sweep, tmp_path):
    proc, out = saved_sweep
    assert proc.returncode == 0
    bad = run_cli("export", str(tmp_path / "missing.npz"), "--out", str(tmp_path / "e"))
    assert bad.returncode == 2 and "no such file" in bad.stderr
    bad = run_cli("export", str(out / "x.npz"), "--out", str(tmp_path / "e"), "--formats", "png,gif")
    assert bad.returncode == 2 and "gif" in bad.stderr
    done = run_cli("export", str(out / "x.npz"), "--out", str(tmp_path / "e"), "--formats", "png,csv", "--stem", "trace")
    assert done.returncode == 0, done.stderr[-3000:]
    e = tmp_path / "e"
    assert sorted(p.name for p in e.iterdir()) == ["trace.csv", "trace.manifest.json", "trace_post_block.png"]
    assert done.stdout.split() == [str(e / n) for n in ("trace.csv", "trace_post_block.png", "trace.manifest.json")]
    assert (e / "trace_post_block.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = (e / "trace.csv").read_text().splitlines()
    res = SweepResult.load(out / "x.npz")
    assert len(rows) == 1 + len(res.layers) * len(res.positions)  # header + one row per cell
    bad_stem = run_cli("export", str(out / "x.npz"), "--out", str(tmp_path / "f"), "--stem", "../up")
    assert bad_stem.returncode == 2, bad_stem.stderr


def test_bad_layers_exit_2_naming_the_field(server_url, tasks):
    args = _sweep_args(server_url, tasks)
    i = args.index("--layers")
    unparsable = run_cli(*args[:i + 1], "zero:six", *args[i + 2:])
    assert unparsable.returncode == 2 and "layers:" in unparsable.stderr, unparsable.stderr
    out_of_range = run_cli(*args[:i + 1], "0:99", *args[i + 2:], "--no-progress")
    assert out_of_range.returncode == 2, out_of_range.stderr
    assert "field: layers" in out_of_range.stderr and "refused" in out_of_range.stderr
    assert out_of_range.stdout == ""


def test_unreachable_server_exits_1(tasks):
    proc = run_cli(*_sweep_args(f"http://127.0.0.1:{free_port()}", tasks), "--no-progress")
    assert proc.returncode == 1 and "cannot talk to the server" in proc.stderr


def test_option_parsing_builds_the_request():
    from app.cli.main import build_parser
    from app.cli.sweep import OptionError, build_request

    # the selector grammar itself is tested in tests/test_sites.py; here: errors name the field
    for opt, bad, field in (("--layers", "1,,2", "layers"), ("--positions", "span:", "positions"),
                            ("--subject", "#1", "subject"), ("--noise-positions", "span:x", "noise.positions"),
                            ("--mask", "all", "mask"), ("--mask", "1-x", "mask")):
        with pytest.raises(OptionError) as info:
            build_request(build_parser().parse_args(["sweep", "--prompt", "P", opt, bad]))
        assert info.value.field == field
    args = build_parser().parse_args([
        "sweep", "--prompt", "P", "--answer", " A", "--foil-id", "7", "--hooks", "pre_attn, post_block", "--layers", "0:4",
        "--positions", "span:Garrow", "--positions", "5-6", "--noise-span", "Garrow#0", "--noise-scale", "2.5", "--alpha", "0.5", "--keep-source",
        "--mask", "3,0-1"])
    assert build_request(args) == {
        "prompt": "P", "answer_token": " A", "foil_token_id": 7, "alpha": 0.5, "hooks": ["pre_attn", "post_block"],
        "mask": {"indices": [0, 1, 3]},
        "layers": [0, 1, 2, 3], "positions": [{"span": "Garrow", "occurrence": 0}, 5, 6],
        "noise": {"span": "Garrow", "occurrence": 0, "scale": 2.5}, "keep_source": True}
    # --prefix-reuse / --no-prefix-reuse send the field; neither leaves it to the server
    for flag, value in (("--prefix-reuse", True), ("--no-prefix-reuse", False)):
        assert build_request(build_parser().parse_args(["sweep", "--prompt", "P", flag]))["prefix_reuse"] is value
    assert "prefix_reuse" not in build_request(build_parser().parse_args(["sweep", "--prompt", "P"]))
    with pytest.raises(OptionError) as info:
        build_request(build_parser().parse_args(["sweep", "--prompt", "P", "--noise-seed", "1"]))
    assert info.value.field == "noise"
