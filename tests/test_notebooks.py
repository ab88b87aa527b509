"""The notebooks in notebooks/ run headless (nbclient, a real kernel) against the real test server
without a cell error and print what they promise. Executed copies go to
`$CAUSALBOARD_TEST_OUT/notebooks/` (default test-output/notebooks/); the committed notebooks are
never overwritten (refresh them with scripts/execute_notebooks.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"


def _runner():
    spec = importlib.util.spec_from_file_location("execute_notebooks", REPO / "scripts" / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def out_dir() -> Path:
    out = Path(os.environ.get("CAUSALBOARD_TEST_OUT", REPO / "test-output")) / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _run(name: str, server_url: str, out_dir: Path, extra_env: dict | None = None) -> nbformat.NotebookNode:
    src = NOTEBOOKS / f"{name}.ipynb"
    before = src.read_bytes()
    out = out_dir / src.name
    out.unlink(missing_ok=True)
    _runner().execute(src, out, server_url, timeout=600, extra_env=extra_env)
    assert src.read_bytes() == before, "the committed notebook must not be overwritten"
    nb = nbformat.read(out, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    return nb


def _stdout(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream" and o.name == "stdout")


def _mimes(nb) -> list[str]:
    return [m for c in nb.cells if c.cell_type == "code" for o in c.outputs for m in o.get("data", {})]


def test_committed_notebooks_are_clean_and_executed():
    """Committed with outputs from a real run, a kernelspec (JupyterLab automation needs one),
    Markdown explanations and a link to the concepts page."""
    names = sorted(p.name for p in NOTEBOOKS.glob("0*.ipynb"))
    assert names == ["01_causal_tracing.ipynb", "02_steering_sliders.ipynb", "03_export_for_papers.ipynb",
                     "04_dynamic_steering.ipynb"]
    for name in names:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["kernelspec"]["name"] == "python3"
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(c.execution_count for c in code), f"{name}: commit it executed (scripts/execute_notebooks.py)"
        assert not [o for c in code for o in c.outputs if o.output_type == "error"]
        markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        assert "../docs/concepts.md" in markdown and len(markdown) > 800


def test_01_causal_tracing(server_url, out_dir, tasks):
    nb = _run("01_causal_tracing", server_url, out_dir)
    out = _stdout(nb)
    pair = tasks["pairs"][0]
    assert f"clean:   {pair['clean_prompt']!r}" in out
    top = re.findall(r"^TOP  (\w+)\s+L(\d+)\s+pos (\d+) .* recovered ([+-][\d.]+)$", out, re.M)
    assert len(top) == 6
    assert all(-0.5 <= float(v) <= 1.5 for *_x, v in top) and float(top[0][3]) > 0.5
    assert "alignment: prefix" in out and "checksum consistent: True" in out
    noise_top = re.findall(r"^NOISE-TOP  L(\d+)\s+pos (\d+)", out, re.M)
    assert len(noise_top) == 4
    # the pair sweep's post_block, the noise sweep, the ROME-style average by token role
    assert _mimes(nb).count("image/png") == 3
    html = [o.data["text/html"] for c in nb.cells if c.cell_type == "code" for o in c.outputs if "text/html" in o.get("data", {})]
    # the sweep's progress bar, one output updated in place, ends finished with every cell
    bars = [h for h in html if 'data-cb="sweep-progress"' in h]
    assert len(bars) == 1 and 'data-state="done"' in bars[0]
    assert re.search(r'data-done="(\d+)" data-total="\1"', bars[0])
    # the SweepResult as a cell's value: its summary and one heatmap per hook, not its grids
    shown = [h for h in html if 'data-cb="sweep-result"' in h]
    assert len(shown) == 1 and shown[0].count('data-cb="heatmap"') == 2 and shown[0].count("data:image/png;base64,") == 2
    # the average trace by token role (ROME's Figure 2): the subject's last token carries the fact
    # in the first layer, the last token in the last one
    avg = [[float(x) for x in row.split()] for row in re.findall(r"^AVG L\d+\s+(.*)$", out, re.M)]
    assert len(avg) == 8 and all(len(row) == 4 for row in avg)
    assert avg[0][0] > 0.3 > avg[0][3] and avg[-1][3] > 0.7 > avg[-1][0]
    assert "application/vnd.holoviews_exec.v0+json" in _mimes(nb)  # the TracingView was displayed
    m = re.search(r"dashboard sweep finished: (\w+), cells done (\d+)", out)
    assert m and m.group(1) == "True" and int(m.group(2)) > 0


def test_02_steering_sliders(server_url, out_dir, http):
    try:
        nb = _run("02_steering_sliders", server_url, out_dir)
    finally:
        http.delete("/v1/steering/vectors/capital_minus_language")
    out = _stdout(nb)
    assert re.search(r"site: L2\.post_block", out) and re.search(r"norm: \d+\.\d+", out)
    table = re.findall(r"^(.+?)\s{2,}(-?\d\.\d)\s{2}'(.*)'$", out, re.M)
    assert len(table) == 3 * 7
    changed = re.search(r"STEERING CHANGED (\d+) of 3", out)
    assert changed and int(changed.group(1)) >= 1
    baseline = re.search(r"^baseline: '(.*)'$", out, re.M).group(1)
    steered = re.search(r"^steered:  '(.*)'  \(capital_minus_language @ L2\.post_block × \+1\.50", out, re.M).group(1)
    assert baseline and steered and baseline != steered
    assert "application/vnd.holoviews_exec.v0+json" in _mimes(nb)  # the SteeringView was displayed


def test_03_export_for_papers(server_url, out_dir):
    import numpy as np

    from app.figures.export import check_files
    from app.sweep.result import SweepResult

    export_dir = out_dir / "exports"
    for old in export_dir.rglob("*"):
        if old.is_file():
            old.unlink()
    nb = _run("03_export_for_papers", server_url, out_dir, {"CAUSALBOARD_EXPORT_DIR": str(export_dir)})
    out = _stdout(nb)
    hooks = ("post_attn", "post_block")
    expected = {"pair1.csv", "pair1.npz", "pair1.manifest.json"} | {f"pair1_{h}.{ext}" for h in hooks for ext in ("pdf", "svg", "png")}
    assert expected <= {p.name for p in export_dir.iterdir()}
    manifest_path = export_dir / "pair1.manifest.json"
    assert check_files(manifest_path) == []
    assert "files matching the manifest's checksums: True" in out
    assert out.count("grid identical = True") == 2
    assert out.count("byte-identical to the first export: True") == 6
    # the NPZ written by the notebook holds the manifest's grids
    summary = json.loads(manifest_path.read_text())["summary"]
    for hook in hooks:
        np.testing.assert_array_equal(SweepResult.load(export_dir / "pair1.npz").to_numpy(hook),
                                      SweepResult.from_summary(summary).to_numpy(hook))
    assert "image/png" in _mimes(nb)


def test_04_dynamic_steering(server_url, out_dir, http):
    export_dir = out_dir / "exports-04"
    for old in export_dir.glob("dynamic_trace.*"):
        old.unlink()
    try:
        nb = _run("04_dynamic_steering", server_url, out_dir, {"CAUSALBOARD_EXPORT_DIR": str(export_dir)})
    finally:
        http.delete("/v1/steering/vectors/dyn_capital_minus_language")
        http.delete("/v1/steering/probes/capital_probe")
    out = _stdout(nb)
    assert "probe: capital_probe at L3.post_block kind direction" in out
    prompts = re.findall(r"^PROMPT '(.*)'\n  without policy: '(.*)'\n  with policy:    '(.*)'\n  engaged: ([.#]+) ", out, re.M)
    assert len(prompts) == 2
    capital = prompts[0]
    assert capital[3][0] == "." and "#" in capital[3]  # never the first token; engaged after the probe fired
    assert capital[1] != capital[2]  # steering changed the continuation
    assert "determinism: {'consistent': True" in out
    assert {p.name for p in export_dir.glob("dynamic_trace.*")} == {"dynamic_trace.png", "dynamic_trace.json"}
    saved = json.loads((export_dir / "dynamic_trace.json").read_text())
    assert len(saved["rows"]) == 10 and any(r["engaged"] for r in saved["rows"])
    assert re.search(r"^panel: ok: steering engaged on \d+ of 10 tokens", out, re.M)
    assert "image/png" in _mimes(nb) and "application/vnd.holoviews_exec.v0+json" in _mimes(nb)
