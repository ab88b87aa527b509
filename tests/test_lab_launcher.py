"""`make lab`'s launcher, scripts/lab.sh, with its defaults: JupyterLab on loopback, on notebooks/,
the `causalboard` kernel registered in the virtualenv (pointing at its python) and the default
for new notebooks, no browser opened without a display, kernels importing this checkout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.browser", "tests.jupyterlab")

from tests.conftest import REPO  # noqa: E402
from tests.jupyterlab import JupyterLab  # noqa: E402


@pytest.fixture
def lab(tmp_path):
    # no LAB_HOST / LAB_ROOT / LAB_OPEN: lab.sh's defaults; the server URL is never used here
    lab = JupyterLab(tmp_path, "http://127.0.0.1:9", env={"LAB_HOST": None, "LAB_ROOT": None, "LAB_OPEN": None})
    try:
        yield lab.start()
    finally:
        lab.stop()


def test_lab_sh_defaults(lab):
    venv = Path(sys.prefix).resolve()
    specs = lab.api("/api/kernelspecs")
    assert specs["default"] == "causalboard"
    spec = specs["kernelspecs"]["causalboard"]["spec"]
    assert spec["argv"][0] == str(venv / "bin" / "python") and "ipykernel_launcher" in spec["argv"]
    assert (venv / "share/jupyter/kernels/causalboard/kernel.json").is_file()

    # root: the repository's notebooks/ folder
    names = {item["name"] for item in lab.api("/api/contents")["content"]}
    assert {"01_causal_tracing.ipynb", "02_steering_sliders.ipynb", "03_export_for_papers.ipynb"} <= names

    # loopback only, no browser without a display, this checkout first on the kernels' PYTHONPATH
    assert f"http://127.0.0.1:{lab.port}/lab" in lab.log_path.read_text()
    listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    ours = [f[1] for f in listening if f[3] == "0A" and int(f[1].split(":")[1], 16) == lab.port]
    assert ours == [f"0100007F:{lab.port:04X}"], ours
    listening6 = [line.split() for line in Path("/proc/net/tcp6").read_text().splitlines()[1:]]
    assert not [f for f in listening6 if f[3] == "0A" and int(f[1].split(":")[1], 16) == lab.port]
    cmdline = Path(f"/proc/{lab.process.pid}/cmdline").read_bytes().split(b"\0")
    assert b"--ServerApp.open_browser=False" in cmdline and b"--ServerApp.ip=127.0.0.1" in cmdline
    environ = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{lab.process.pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
    assert environ[b"PYTHONPATH"].split(os.pathsep.encode())[0] == str(REPO.resolve()).encode()
