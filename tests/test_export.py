"""Figure and data export of a patch sweep (app/figures/export.py). No engine: the result is built from a
hand-written summary shaped like the server's (2 hooks, an unaligned position, a voided cell,
within-noise cells, subject positions, token strings with `$`, spaces and `<`), and every file is
checked by reading its bytes (PDF objects and fonts, SVG elements, PNG header, CSV rows, NPZ)."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import xml.etree.ElementTree as ET
import zipfile
import zlib
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from matplotlib.collections import QuadMesh
from matplotlib.colors import TwoSlopeNorm
from PIL import Image

from app.figures import export
from app.figures.presentation import CELL_LOOKS, SEQUENTIAL, SUBJECT_LEGEND, legend_text, token_label
from app.figures.style import WIDTHS, literal
from app.sweep.fold import CellStatus
from app.sweep.fold import result_from_events
from app.sweep.result import SweepResult
from engine_ext.errors import SpecError

LAYERS = list(range(6))
HOOKS = ["post_block", "post_attn"]
# corrupt prompt "The $5 capital of Tarn Vale is" vs clean "The $ capital of North Kell is":
# prefix 3 tokens and suffix 5 tokens align, corrupt position 3 ("5") has no clean counterpart.
TOKENS = ["<s>", "The", " $", "5", " capital", " of", " Tarn", " Vale", " is"]
CLEAN_TOKENS = ["<s>", "The", " $", " capital", " of", " North", " Kell", " is"]
POSITIONS = list(range(len(TOKENS)))
SUBJECT = [6, 7]
UNALIGNED = 3
VOIDED = ("post_attn", 2, 5)
WITHIN_NOISE = [("post_block", 0, 1), ("post_block", 1, 2), ("post_attn", 4, 0)]
NOISE_FLOOR = 0.05


def _grid(hook: str) -> list[list[float | None]]:
    """A ROME-like pattern: the subject's last token matters early, the last token late."""
    rng = np.random.default_rng(0 if hook == "post_block" else 1)
    rows = []
    for layer in LAYERS:
        row: list[float | None] = []
        for pos in POSITIONS:
            if pos == UNALIGNED:
                row.append(None)
                continue
            v = 0.12 * rng.standard_normal()
            if pos == 7:
                v += 0.95 * max(0.0, 1 - layer / 4.5)
            if pos == 6:
                v += 0.3 * max(0.0, 1 - layer / 3)
            if pos == 8:
                v += 1.05 * layer / 5 if hook == "post_block" else 0.5 * layer / 5
            row.append(round(v, 6))
        rows.append(row)
    for h, layer, pos in WITHIN_NOISE:
        if h == hook:
            rows[layer][pos] = 0.01 * (layer + 1)
    if hook == VOIDED[0]:
        rows[VOIDED[1]][VOIDED[2]] = None
    return rows


def synthetic_summary() -> dict:
    """The summary object of `POST /v1/patch_sweep` (wire format: `SweepSummary` in app/sweep/schema.py)."""
    hook_grids = [{"hook": h, "grid": _grid(h), "argmax": None} for h in HOOKS]
    return {
        "sweep_id": "sw-synthetic-0001", "model": "causalboard-tiny (synthetic example)",
        "prompt": "The $5 capital of Tarn Vale is", "clean_prompt": "The $ capital of North Kell is",
        "prompt_token_ids": [1, 141, 17, 23, 178, 222, 138, 151, 205],
        "token_strings": TOKENS,
        "clean_token_ids": [1, 141, 17, 178, 222, 160, 161, 205], "clean_token_strings": CLEAN_TOKENS,
        "layers": LAYERS, "positions": POSITIONS, "hook": HOOKS[0], "hooks": HOOKS,
        "grid": hook_grids[0]["grid"], "hook_grids": hook_grids, "argmax": None,
        "metric": "recovered", "metric_requested": "recovered", "recovered_basis": "logprob",
        "clean": -0.21, "corrupt": -4.87, "alpha": 1.0,
        "answer_token_id": 310, "answer_token": " Quell", "foil_token_id": None, "foil_token": None,
        "source": {"kind": "run", "run_id": "auto-clean-1"}, "noise": None,
        "skipped": [{"position": UNALIGNED, "reason": "unaligned: no clean counterpart"},
                    {"hook": VOIDED[0], "layer": VOIDED[1], "position": VOIDED[2], "reason": "source run evicted"}],
        "alignment": {"n_clean": 8, "n_corrupt": 9, "prefix_len": 3, "suffix_len": 5,
                      "unaligned_positions": [UNALIGNED],
                      "position_map": {"0": 0, "1": 1, "2": 2, "4": 3, "5": 4, "6": 5, "7": 6, "8": 7}},
        "noise_floor": NOISE_FLOOR, "noise_floor_detail": {"solo": 0.0, "in_batch": [0.03, 0.05], "units": "recovered"},
        "within_noise": [{"hook": h, "layer": layer, "position": p} for h, layer, p in WITHIN_NOISE],
        "subject_positions": SUBJECT,
        "checksum": {"consistent": True, "ranks": [{"rank": 0, "checksum": "9f2c1e0a77d3b4c5"}]},
        "auto_captured": True, "captured_source_run": "auto-clean-1",
        "cells_total": 108, "cells_done": 95, "cells_voided": 1, "elapsed_s": 3.2, "cancelled": False,
        "notes": [], "versions": {"causalboard": "0.1.0", "vllm": "0.25.1"},
    }


@pytest.fixture()
def result() -> SweepResult:
    return SweepResult.from_summary(synthetic_summary())


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("export")
    manifest = export.export_sweep(SweepResult.from_summary(synthetic_summary()), out, stem="trace")
    return out, manifest


# ---- PDF reading (no PDF library installed): objects, inflated streams, ToUnicode text ----------
def _pdf_objects(data: bytes) -> dict[int, tuple[bytes, bytes]]:
    """obj number -> (dictionary bytes, inflated stream bytes or b"")."""
    objs = {}
    for m in re.finditer(rb"(\d+) 0 obj(.*?)endobj", data, re.S):
        body = m.group(2)
        stream = b""
        s = re.search(rb"stream\r?\n(.*?)\r?\nendstream", body, re.S)
        head = body
        if s:
            head = body[: s.start()]
            raw = s.group(1)
            stream = zlib.decompress(raw) if b"/FlateDecode" in head else raw
        objs[int(m.group(1))] = (head, stream)
    return objs


def _pdf_text(objs: dict[int, tuple[bytes, bytes]]) -> list[str]:
    """The strings drawn by each `TJ`/`Tj` operator, decoded (2-byte codes, Identity-H) through
    the fonts' ToUnicode CMaps (`bfchar` and `bfrange`, both range forms)."""
    mapping: dict[int, str] = {}

    def utf16(h: bytes) -> str:
        return bytes.fromhex(h.decode()).decode("utf-16-be")

    for _, stream in objs.values():
        if b"begincmap" not in stream:
            continue
        for block in re.findall(rb"beginbfchar(.*?)endbfchar", stream, re.S):
            for src, dst in re.findall(rb"<([0-9A-Fa-f]+)>\s*<([0-9A-Fa-f]+)>", block):
                mapping[int(src, 16)] = utf16(dst)
        for block in re.findall(rb"beginbfrange(.*?)endbfrange", stream, re.S):
            for lo, hi, dst in re.findall(rb"<([0-9A-Fa-f]+)>\s*<([0-9A-Fa-f]+)>\s*(\[.*?\]|<[0-9A-Fa-f]+>)", block, re.S):
                codes = range(int(lo, 16), int(hi, 16) + 1)
                if dst.startswith(b"["):
                    mapping.update(zip(codes, (utf16(h) for h in re.findall(rb"<([0-9A-Fa-f]+)>", dst))))
                else:
                    start = ord(utf16(dst[1:-1]))
                    mapping.update((c, chr(start + k)) for k, c in enumerate(codes))
    assert mapping, "no ToUnicode CMap"
    texts = []
    for _, stream in objs.values():
        for m in re.finditer(rb"\[(.*?)\]\s*TJ|(\((?:\\.|[^\\)])*\)|<[0-9A-Fa-f]*>)\s*Tj", stream, re.S):
            raw = b"".join(_pdf_string(tok) for tok in re.findall(rb"\((?:\\.|[^\\)])*\)|<[0-9A-Fa-f]*>", m.group(0)))
            texts.append("".join(mapping.get(int.from_bytes(raw[i:i + 2], "big"), "\ufffd") for i in range(0, len(raw) - 1, 2)))
    return texts


def _pdf_string(token: bytes) -> bytes:
    """Bytes of one PDF string token: `<hex>` or `(literal)` with backslash escapes."""
    if token.startswith(b"<"):
        return bytes.fromhex(token[1:-1].decode())
    body, out, i = token[1:-1], bytearray(), 0
    escapes = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("b"): 8, ord("f"): 12}
    while i < len(body):
        c = body[i]
        if c == 0x5C and i + 1 < len(body):
            nxt = body[i + 1]
            octal = re.match(rb"[0-7]{1,3}", body[i + 1:i + 4])
            if octal:
                out.append(int(octal.group(0), 8) & 0xFF)
                i += 1 + len(octal.group(0))
                continue
            out.append(escapes.get(nxt, nxt))
            i += 2
            continue
        out.append(c)
        i += 1
    return bytes(out)


# ---- figures -------------------------------------------------------------------------------------
def test_pdf_is_vector_with_embedded_truetype_fonts_and_real_text(exported):
    out, _ = exported
    for hook in HOOKS:
        data = (out / f"trace_{hook}.pdf").read_bytes()
        objs = _pdf_objects(data)
        fonts = [num for num, (head, _) in objs.items() if re.search(rb"/Type\s*/Font\b", head)]
        assert fonts
        descriptors = [head for head, _ in objs.values() if b"/FontDescriptor" in head and b"/FontName" in head]
        assert descriptors and all(b"/FontFile2" in d or b"/FontFile3" in d for d in descriptors)
        assert not any(re.search(rb"/Subtype\s*/Type3", head) for head, _ in objs.values())
        assert not any(re.search(rb"/Subtype\s*/Image", head) for head, _ in objs.values())
        assert b"/ToUnicode" in data
        texts = _pdf_text(objs)
        for label in ("layer", "recovered (logprob)", "␣Vale*", "␣Tarn*", "<s>", "␣$", "5", "␣is"):
            assert label in texts, (label, texts)
        assert any(t.startswith(hook) for t in texts)
        assert not any("\\$" in t for t in texts)  # escaped for matplotlib, drawn as a plain "$"


def test_svg_text_stays_text_and_nothing_is_raster(exported):
    out, _ = exported
    root = ET.parse(out / "trace_post_block.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert not list(root.iter(f"{ns}image"))
    texts = ["".join(t.itertext()) for t in root.iter(f"{ns}text")]
    for label in ("<s>", "The", "␣$", "5", "␣capital", "␣of", "␣Tarn*", "␣Vale*", "␣is"):
        assert label in texts, (label, texts)
    assert "recovered (logprob)" in texts and "layer" in texts
    assert any(t.startswith("post_block") for t in texts)
    raw = (out / "trace_post_block.svg").read_text()
    assert "data:image" not in raw and "font-weight: 700" in raw  # subject tokens bold


def test_png_is_300_dpi_and_one_column_wide(exported):
    out, _ = exported
    with Image.open(out / "trace_post_attn.png") as im:
        dpi = im.info["dpi"]
        assert round(dpi[0]) == round(dpi[1]) == 300
        assert im.width == round(WIDTHS["single"] * 300)
        assert 1.5 * 300 < im.height < 5 * 300
        pixels = np.asarray(im.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # a coloured heatmap, not a blank page


def test_double_width_and_no_rasterized_artists(result, tmp_path):
    fig = export.plot_sweep(result, "post_attn", width="double")
    assert fig.get_size_inches()[0] == pytest.approx(WIDTHS["double"])
    assert not [a for a in fig.findobj() if getattr(a, "get_rasterized", lambda: False)()]
    export.save_figure(fig, tmp_path / "d.png", "png")
    with Image.open(tmp_path / "d.png") as im:
        assert im.width == round(WIDTHS["double"] * 300)
    taller = SweepResult.from_summary({**synthetic_summary(), "layers": list(range(12)), "hook_grids": None,
                                       "grid": _grid("post_block") * 2, "hooks": ["post_block"]})
    assert export.plot_sweep(taller).get_size_inches()[1] > export.plot_sweep(result).get_size_inches()[1]


def test_recovered_is_diverging_centred_at_zero_and_includes_one(result):
    fig = export.plot_sweep(result)
    mesh = next(c for c in fig.axes[0].collections if isinstance(c, QuadMesh))
    norm = mesh.norm
    if isinstance(norm, TwoSlopeNorm):
        assert norm.vcenter == 0
    else:
        assert norm.vmin == -norm.vmax
    assert norm.vmin <= -1 and norm.vmax >= 1
    assert mesh.get_cmap().name.startswith("RdBu")
    assert fig.axes[0].get_ylim() == (0, len(LAYERS))  # rows = layers, layer 0 at the bottom
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][0] == "0"
    # one wild cell does not wash the map out: clipped at ±1.5, shown as a colorbar arrow
    summary = synthetic_summary()
    summary["hook_grids"][0]["grid"][5][8] = 7.0
    mesh = next(c for c in export.plot_sweep(SweepResult.from_summary(summary)).axes[0].collections
                if isinstance(c, QuadMesh))
    assert mesh.norm.vmax == pytest.approx(1.5) and mesh.norm(0.0) == pytest.approx(0.5)
    assert mesh.colorbar.extend in ("max", "both")


def test_other_metrics_pick_their_scales(result):
    ld = synthetic_summary() | {"metric": "logit_diff", "foil_token": " Rome", "foil_token_id": 400,
                                "clean": 3.0, "corrupt": -1.5}
    mesh = _mesh(export.plot_sweep(SweepResult.from_summary(ld)))
    assert mesh.norm(0.0) == pytest.approx(0.5) and mesh.norm.vmax >= 3.0
    assert mesh.colorbar.ax.get_ylabel() == "logit_diff (␣Quell − ␣Rome)"
    lp = synthetic_summary() | {"metric": "logprob"}
    for g in lp["hook_grids"]:
        g["grid"] = [[None if v is None else -4.8 + 4.0 * max(v, 0.0) for v in row] for row in g["grid"]]
    mesh = _mesh(export.plot_sweep(SweepResult.from_summary(lp)))
    assert mesh.get_cmap().name == SEQUENTIAL.name
    assert mesh.norm.vmin <= -4.87 and mesh.norm.vmax >= -0.21  # both baselines inside the range
    assert mesh.colorbar.ax.get_ylabel() == "logprob (␣Quell)"
    mesh = _mesh(export.plot_sweep(result, cmap="viridis", vmin=-0.5, vmax=2.0))
    assert isinstance(mesh.norm, TwoSlopeNorm) and mesh.norm.vcenter == 0 and mesh.norm.vmax == 2.0


def _mesh(fig):
    return next(c for c in fig.axes[0].collections if isinstance(c, QuadMesh))


def _overlays(ax) -> dict[tuple[float, float, float], str]:
    """(x, y, height) -> hatch of every hatched patch over the heatmap."""
    return {(p.get_x(), p.get_y(), p.get_height()): p.get_hatch() for p in ax.patches if p.get_hatch()}


def test_marks_and_legend_follow_the_cell_statuses(result):
    fig = export.plot_sweep(result, "post_attn")
    ax = fig.axes[0]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [SUBJECT_LEGEND, f"within noise floor (±{NOISE_FLOOR:.2g})", "skipped (unaligned)", "voided (patch failed)"]
    skipped, voided, noise = (CELL_LOOKS[s] for s in (CellStatus.SKIPPED, CellStatus.VOIDED, CellStatus.NOISE))
    hatched = _overlays(ax)
    assert {k: v[0] for k, v in hatched.items()} == {
        (UNALIGNED, 0, len(LAYERS)): skipped.hatch,  # the whole unaligned column, one patch
        (VOIDED[2], VOIDED[1], 1): voided.hatch,
        (0, 4, 1): noise.hatch,  # the within-noise cell of post_attn only
    }
    voided_patch = next(p for p in ax.patches if p.get_hatch() and p.get_x() == VOIDED[2])
    assert matplotlib.colors.to_hex(voided_patch.get_facecolor()) == voided.fill
    assert not ax.lines
    ticks = ax.get_xticklabels()
    assert [t.get_fontweight() for t in ticks].count("bold") == 2
    assert ticks[2].get_text() == r"␣\$"  # escaped: never parsed as mathtext
    # the server's threshold (noise floor raised to a minimum effect) is what the dots mean
    raised = SweepResult.from_summary(synthetic_summary() | {"within_noise_threshold": 0.08})
    assert "within noise floor (±0.08)" in [t.get_text() for t in export.plot_sweep(raised).legends[0].get_texts()]
    # post_block has no voided cell: not in its legend; without marks there is no legend at all
    assert legend_text(CellStatus.VOIDED) not in [t.get_text() for t in export.plot_sweep(result).legends[0].get_texts()]
    bare = export.plot_sweep(result, show_marks=False)
    assert not bare.legends and not bare.axes[0].lines and not [p for p in bare.axes[0].patches if p.get_hatch()]


def test_draws_into_a_given_axes(result):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3))
    axes = fig.subplots(1, 2)
    for ax, hook in zip(axes, HOOKS):
        assert export.plot_sweep(result, hook, ax=ax, title="") is fig
    assert not fig.legends and all(ax.get_legend() is not None for ax in axes)
    assert axes[1].get_title(loc="left") == ""


def test_token_labels():
    assert token_label(" Paris") == "␣Paris"
    assert token_label("$x$") == "$x$" and literal(token_label("$x$")) == r"\$x\$"  # escaped for matplotlib only
    assert token_label("\n") == "↵" and token_label("") == "∅" and token_label("a\tb") == "a⇥b"
    assert token_label("\x00") == "\\x00" and token_label("\u00a0") == "\\xa0"
    assert token_label("x" * 40).endswith("…") and len(token_label("x" * 40)) == 14


# ---- data files and manifest ---------------------------------------------------------------------
def test_csv_rows_and_statuses(exported, result):
    out, _ = exported
    rows = list(csv.DictReader(io.StringIO((out / "trace.csv").read_text())))
    assert len(rows) == len(HOOKS) * len(LAYERS) * len(POSITIONS)
    assert list(rows[0]) == list(export.CSV_COLUMNS)
    status = {(r["hook"], int(r["layer"]), int(r["position"])): r["status"] for r in rows}
    for hook in HOOKS:
        for layer in LAYERS:
            assert status[(hook, layer, UNALIGNED)] == "skipped"
    assert status[VOIDED] == "voided"
    for cell in WITHIN_NOISE:
        assert status[cell] == "within_noise"
    counts = {s: list(status.values()).count(s) for s in export.STATUSES}
    assert counts == {"ok": 2 * 6 * 9 - 12 - 1 - 3, "skipped": 12, "voided": 1, "pending": 0, "within_noise": 3}
    by_cell = {(r["hook"], int(r["layer"]), int(r["position"])): r for r in rows}
    for hook in HOOKS:
        grid = result.to_numpy(hook)
        for i, layer in enumerate(LAYERS):
            for j, pos in enumerate(POSITIONS):
                r = by_cell[(hook, layer, pos)]
                assert r["token"] == TOKENS[pos]
                assert (r["value"] == "") if math.isnan(grid[i, j]) else float(r["value"]) == grid[i, j]


def test_pending_cells_of_an_unfinished_sweep(result):
    partial = SweepResult.from_summary(synthetic_summary())
    partial.grids["post_block"][4:, :] = np.nan
    statuses = export.cell_statuses(partial, "post_block")
    assert (statuses[4:, UNALIGNED] == "skipped").all()
    assert (np.delete(statuses[4:], UNALIGNED, axis=1) == "pending").all()
    assert legend_text(CellStatus.PENDING) in [t.get_text() for t in export.plot_sweep(partial).legends[0].get_texts()]


def test_a_live_stream_exports_mid_sweep():
    """The dashboard's download buttons work on a result folded from the SSE events so far."""
    s = synthetic_summary()
    start = {"type": "start", "sweep_id": s["sweep_id"], "layers": LAYERS, "positions": POSITIONS, "hook": HOOKS[0],
             "hooks": HOOKS, "metric": "recovered", "token_strings": TOKENS, "subject_positions": SUBJECT, "cells_total": 108}
    events = [start, {"type": "skip", "position": UNALIGNED, "reason": "unaligned"},
              {"type": "cell", "hook": "post_block", "layer": 0, "position": 7, "value": 0.93},
              {"type": "cell", "hook": "post_attn", "layer": 2, "position": 5, "value": None, "error": "source run evicted"},
              {"type": "progress", "done": 3, "total": 108, "voided": 1, "elapsed_s": 0.5, "cells_per_s": 6.0}]
    live = result_from_events(events)
    rows = list(csv.DictReader(io.StringIO(export.export_bytes(live, "csv").decode())))
    counts = {st: sum(r["status"] == st for r in rows) for st in export.STATUSES}
    assert counts == {"ok": 1, "skipped": 12, "voided": 1, "pending": 108 - 14, "within_noise": 0}
    fig = export.plot_sweep(live, "post_attn")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        SUBJECT_LEGEND, "skipped (unaligned)", "voided (patch failed)", "pending (no value yet)"]
    with Image.open(io.BytesIO(export.export_bytes(live, "png", hook="post_attn"))) as im:
        assert im.width == 1050


def test_manifest_describes_the_sweep_and_hashes_every_file(exported):
    out, manifest = exported
    assert json.loads((out / "trace.manifest.json").read_text()) == manifest
    names = {f"trace_{h}.{f}" for h in HOOKS for f in ("pdf", "svg", "png")} | {"trace.csv", "trace.npz"}
    assert set(manifest["files"]) == names
    import hashlib

    for name, entry in manifest["files"].items():
        data = (out / name).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["bytes"] == len(data)
    assert export.check_files(out / "trace.manifest.json") == []
    s = synthetic_summary()
    for key in ("model", "prompt", "clean_prompt", "prompt_token_ids", "token_strings", "clean_token_ids",
                "clean_token_strings", "alpha", "answer_token_id", "answer_token", "foil_token_id",
                "noise_floor", "noise", "alignment", "skipped", "checksum", "subject_positions", "within_noise"):
        assert manifest[key] == s[key], key
    assert manifest["metric"] == "recovered" and manifest["metric_requested"] == "recovered"
    assert manifest["recovered_basis"] == "logprob"
    assert manifest["sites"]["names"][:2] == ["L0.post_block", "L1.post_block"] and len(manifest["sites"]["names"]) == 12
    assert manifest["positions"] == POSITIONS and manifest["position_tokens"] == TOKENS
    assert manifest["versions"]["sweep"] == s["versions"] and manifest["versions"]["export"]["matplotlib"]
    assert manifest["export"] == {"stem": "trace", "formats": list(export.DEFAULT_FORMATS), "hooks": HOOKS,
                                  "width": "single", "png_dpi": 300}
    assert manifest["cells"]["by_status"]["voided"] == 1 and manifest["created"]
    assert manifest["summary"]["hook_grids"][1]["hook"] == "post_attn"


def test_npz_and_manifest_regenerate_the_identical_grids(exported, result, tmp_path):
    out, _ = exported
    from_npz = SweepResult.load(out / "trace.npz")
    redrawn = tmp_path / "redrawn"
    from_manifest = export.regenerate(out / "trace.manifest.json", out_dir=redrawn)
    for other in (from_npz, from_manifest):
        assert other.hooks == HOOKS and other.layers == LAYERS and other.positions == POSITIONS
        for hook in HOOKS:
            a, b = result.to_numpy(hook), other.to_numpy(hook)
            assert np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a, b, equal_nan=True)
        assert other.meta["within_noise"] == result.meta["within_noise"]
    # the figures are a pure function of the data: redrawing gives the same bytes
    manifest = json.loads((out / "trace.manifest.json").read_text())
    for name, entry in manifest["files"].items():
        if entry["format"] in export.FIGURE_FORMATS:
            assert hashlib_of(redrawn / name) == entry["sha256"], name
    # a damaged file is reported
    damaged = tmp_path / "copy"
    damaged.mkdir()
    for f in out.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    (damaged / "trace.csv").write_text("hook,layer\n")
    (damaged / "trace_post_attn.svg").unlink()
    assert sorted(export.check_files(damaged / "trace.manifest.json")) == ["trace.csv", "trace_post_attn.svg"]


def hashlib_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_bytes_match_the_files(exported, result, tmp_path):
    out, _ = exported
    assert export.export_bytes(result, "svg", hook="post_attn") == (out / "trace_post_attn.svg").read_bytes()
    assert export.export_bytes(result, "pdf") == (out / "trace_post_block.pdf").read_bytes()
    assert export.export_bytes(result, "csv") == (out / "trace.csv").read_bytes()
    png = export.export_bytes(result, "png", hook="post_block")
    assert png.startswith(b"\x89PNG") and png == (out / "trace_post_block.png").read_bytes()
    with np.load(io.BytesIO(export.export_bytes(result, "npz"))) as z:
        assert np.array_equal(z["grid_post_attn"], result.to_numpy("post_attn"), equal_nan=True)
    again = SweepResult.from_summary(json.loads(export.export_bytes(result, "json")))
    assert export.export_bytes(result, "json") == result.save(Path(tmp_path) / "s.json").read_bytes()
    assert np.array_equal(again.to_numpy("post_attn"), result.to_numpy("post_attn"), equal_nan=True)
    with zipfile.ZipFile(io.BytesIO(export.export_bytes(result, "zip"))) as zf:
        names = set(zf.namelist())
        assert {"sweep.manifest.json", "sweep.csv", "sweep.npz", "sweep_post_attn.pdf"} <= names
        manifest = json.loads(zf.read("sweep.manifest.json"))
        assert set(manifest["files"]) == names - {"sweep.manifest.json"}


def test_bad_arguments_name_the_field(result, tmp_path):
    cases = [
        (lambda: export.plot_sweep(result, "mlp_out"), "hook"),
        (lambda: export.plot_sweep(result, width="triple"), "width"),
        (lambda: export.plot_sweep(result, vmin=1.0, vmax=0.5), "vmax"),
        (lambda: export.export_bytes(result, "gif"), "format"),
        (lambda: export.export_bytes(result, "svg", hook="pre_attn"), "hook"),
        (lambda: export.export_sweep(result, tmp_path, formats=("pdf", "eps")), "formats[1]"),
        (lambda: export.export_sweep(result, tmp_path, hooks=["post_attn", "x"]), "hooks[1]"),
        (lambda: export.export_sweep(result, tmp_path, stem="../up"), "stem"),
        (lambda: export.regenerate(tmp_path / "missing.manifest.json"), "manifest"),
    ]
    for call, field in cases:
        with pytest.raises(SpecError) as err:
            call()
        assert err.value.field == field
    assert not list(tmp_path.iterdir())  # nothing written for a refused export


def test_subset_of_hooks_and_formats(result, tmp_path):
    manifest = export.export_sweep(result, tmp_path, stem="only", formats=("svg", "json"), hooks=["post_attn"])
    assert set(manifest["files"]) == {"only_post_attn.svg", "only.json"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["only.json", "only.manifest.json", "only_post_attn.svg"]
    again = export.regenerate(tmp_path / "only.manifest.json", out_dir=tmp_path / "again")
    assert [p.name for p in (tmp_path / "again").iterdir()] == ["only_post_attn.svg"]
    assert again.hooks == HOOKS


def test_plot_sweep_width_and_literal_title(result):
    fig = export.plot_sweep(result, "post_attn", width="double", title="custom $x$ title")
    assert fig.get_size_inches()[0] == pytest.approx(7.0)
    assert fig.axes[0].get_title(loc="left") == r"custom \$x\$ title"
