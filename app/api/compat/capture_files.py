"""The reference fork's `filesystem` capture consumer: captured activations written as files under
a root directory the server is started with (`CAUSALBOARD_CAPTURE_DIR`, or
`create_app(capture_dir=...)`), in the fork's on-disk layouts, so its reader
(`vllm/v1/capture/consumers/filesystem/reader.py`) reads them unchanged:

* `per_file` (default) — `{root}/{tag}/{request_id}/{layer}_{hook}.bin` (raw little-endian rows,
  `[positions, hidden]`) + `{layer}_{hook}.json` (`request_id`, `client_request_id`, `layer`,
  `hook`, `shape`, `dtype`, `positions`);
* `packed` — `{root}/{tag}/{request_id}/packed.bin` (every (layer, hook) block concatenated) +
  `packed.json` (`request_id`, `layout: "packed"`, `dtype`, `entries: [{layer, hook, offset,
  nbytes, shape}]`).

Values are the engine's float32 captures (the fork writes the residual's dtype; the sidecar says
which). `tag` and `request_id` are slugged as the fork does (`..`, a leading `/`, empty or > 256
characters refused; other characters outside `[A-Za-z0-9._-]` become `_`).

* `sharded` — `{root}/{tag}/shard-000-{seq:06d}.bin` + `.json` (`layout: "sharded"`, `shard_idx`,
  `seq`, `dtype`, `entries: [{request_id, layer, hook, offset, nbytes, shape}]`): here each
  request seals a shard of its own at once (the fork packs many requests into a shard and seals it
  by size); its reader (`read_sharded(tag_dir)`) reads them the same way.

Request: `capture: {"filesystem": {"request_id"?, "tag"?, "hooks": {hook: "all" | [layers] |
{"layers", "ranges"}}, "positions": "last_prompt" | "all_prompt" | "all_generated" | "all" |
[indices], "layout"?}}`; the response's `capture_results.filesystem` is `{"status", "error",
"payload": {"paths": [...]}}`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine_ext.errors import SpecError
from engine_ext.sites import Site

LAYOUTS = ("per_file", "packed", "sharded")
_SLUG_RE = re.compile(r"[^a-zA-Z0-9._-]")


def slug(name: object, field: str) -> str:
    """A `tag` / `request_id` as a safe path segment (the fork's rules)."""
    if not isinstance(name, str) or not name:
        raise SpecError(field, "must be a non-empty string")
    if len(name) > 256:
        raise SpecError(field, f"must be at most 256 characters, got {len(name)}")
    if ".." in name:
        raise SpecError(field, f"must not contain '..': {name!r}")
    if name.startswith("/"):
        raise SpecError(field, f"must not start with '/': {name!r}")
    return _SLUG_RE.sub("_", name)


@dataclass
class FileCapture:
    """A validated `filesystem` capture request."""

    request_id: str
    tag: str
    sites: list[Site]
    layout: str


def write(root: str | Path, fc: FileCapture, captures: dict[tuple[int, str, int], np.ndarray],
          client_request_id: str) -> list[str]:
    """Write `captures` ((layer, hook, position) -> vector) of `fc.sites`; returns the paths."""
    out_dir = Path(root) / fc.tag / fc.request_id
    if fc.layout != "sharded":
        out_dir.mkdir(parents=True, exist_ok=True)
    blocks = []
    for site in fc.sites:
        keys = sorted(k for k in captures if k[0] == site.layer and k[1] == site.hook)
        rows = np.stack([np.asarray(captures[k], dtype="<f4") for k in keys]) if keys else np.zeros((0, 0), "<f4")
        blocks.append((site, [k[2] for k in keys], np.ascontiguousarray(rows, dtype="<f4")))
    paths: list[str] = []
    if fc.layout == "per_file":
        for site, positions, rows in blocks:
            bin_path = out_dir / f"{site.layer}_{site.hook}.bin"
            bin_path.write_bytes(rows.tobytes())
            side = {"request_id": fc.request_id, "client_request_id": client_request_id, "layer": site.layer,
                    "hook": site.hook, "shape": list(rows.shape), "dtype": "float32", "positions": positions}
            bin_path.with_suffix(".json").write_text(json.dumps(side))
            paths += [str(bin_path), str(bin_path.with_suffix(".json"))]
        return paths
    entries, offset, chunks = [], 0, []
    for site, positions, rows in blocks:
        data = rows.tobytes()
        entries.append({"request_id": fc.request_id, "layer": site.layer, "hook": site.hook, "offset": offset,
                        "nbytes": len(data), "shape": list(rows.shape), "positions": positions})
        chunks.append(data)
        offset += len(data)
    if fc.layout == "sharded":
        return _write_shard(Path(root) / fc.tag, entries, b"".join(chunks))
    (out_dir / "packed.bin").write_bytes(b"".join(chunks))
    index = {"request_id": fc.request_id, "client_request_id": client_request_id, "layout": "packed",
             "dtype": "float32", "entries": entries}
    (out_dir / "packed.json").write_text(json.dumps(index))
    return [str(out_dir / "packed.bin"), str(out_dir / "packed.json")]


def _write_shard(tag_dir: Path, entries: list[dict], data: bytes) -> list[str]:
    """One sealed shard: the next free `shard-000-{seq}` pair of `tag_dir` (claimed with an
    exclusive create, so concurrent requests never share a file)."""
    tag_dir.mkdir(parents=True, exist_ok=True)
    seq = len(list(tag_dir.glob("shard-000-*.json")))
    while True:
        bin_path = tag_dir / f"shard-000-{seq:06d}.bin"
        try:
            with open(bin_path, "xb") as fh:
                fh.write(data)
            break
        except FileExistsError:
            seq += 1
    index = {"layout": "sharded", "shard_idx": 0, "seq": seq, "dtype": "float32", "entries": entries}
    bin_path.with_suffix(".json").write_text(json.dumps(index))
    return [str(bin_path), str(bin_path.with_suffix(".json"))]
