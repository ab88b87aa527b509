#!/usr/bin/env python
"""Execute the notebooks in notebooks/ against a running causalboard server, in place (to
refresh their committed outputs) or into another folder.

    make run &                                           # or any server: --url / $CAUSALBOARD_URL
    .venv/bin/python scripts/execute_notebooks.py        # every notebooks/0*.ipynb, in place
    .venv/bin/python scripts/execute_notebooks.py notebooks/02_steering_sliders.ipynb --out /tmp/nb

Each notebook runs in a fresh `python3` kernel (the one of this interpreter's environment) with
the notebook's folder as working directory, `CAUSALBOARD_URL` set and this checkout first on
`PYTHONPATH`; a cell error stops that notebook, leaves the file untouched and makes the exit
status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_URL = "http://127.0.0.1:8000"


def execute(path: Path, out: Path, url: str, timeout: int = 600, extra_env: dict[str, str] | None = None) -> float:
    """Execute `path` and write the executed notebook to `out`; returns the seconds it took.
    Raises `CellExecutionError` on the first failing cell (nothing is written then)."""
    nb = nbformat.read(path, as_version=4)
    saved = {k: os.environ.get(k) for k in ["CAUSALBOARD_URL", "PYTHONPATH", *(extra_env or {})]}
    # the kernel inherits this environment; PYTHONPATH: it imports this checkout's code, also when
    # the virtualenv (and its editable install) is shared with another checkout
    pythonpath = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ.update({"CAUSALBOARD_URL": url, "PYTHONPATH": pythonpath, **(extra_env or {})})
    try:
        start = time.monotonic()
        NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        elapsed = time.monotonic() - start
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/0*.ipynb")
    parser.add_argument("--url", default=os.environ.get("CAUSALBOARD_URL", DEFAULT_URL))
    parser.add_argument("--out", type=Path, default=None, help="write executed copies here instead of in place")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((REPO / "notebooks").glob("0*.ipynb"))
    failed = 0
    for path in paths:
        out = (args.out / path.name) if args.out else path
        try:
            seconds = execute(path, out, args.url, args.timeout)
        except CellExecutionError as exc:
            failed += 1
            print(f"FAILED {path}:\n{exc}", file=sys.stderr)
            continue
        print(f"ok {path} -> {out} ({seconds:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
