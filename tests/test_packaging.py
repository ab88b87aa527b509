"""The foundation's packaging contracts: plugin registration, version refusal, the bundled model."""

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from engine_ext import BUNDLED_MODEL_PATH
from engine_ext.worker import seam

from .conftest import REPO


def test_vllm_plugin_entry_point_is_registered():
    eps = metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "causalboard"]
    assert ours, "causalboard is not registered under vllm.general_plugins"
    assert ours[0].load() is seam.register_plugin


def test_console_script_is_registered():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("causalboard") == "app.cli.main:main"


def test_installed_vllm_is_the_checked_version():
    assert seam.check_vllm_version().split("+")[0] == seam.VLLM_VERSION_CHECKED == "0.25.1"


def test_other_vllm_version_is_refused(monkeypatch):
    monkeypatch.setattr(seam, "installed_vllm_version", lambda: "0.26.0")
    with pytest.raises(seam.VllmVersionError, match="checked against vLLM 0.25.1"):
        seam.register_plugin()


def test_app_never_imports_vllm():
    offenders = []
    for path in (REPO / "app").rglob("*.py"):
        text = path.read_text()
        if "import vllm" in text or "from vllm" in text:
            offenders.append(str(path))
    assert not offenders


def test_bundled_model_fits_the_contract():
    files = {p.name for p in BUNDLED_MODEL_PATH.iterdir()}
    for need in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert need in files
    size = sum(p.stat().st_size for p in BUNDLED_MODEL_PATH.iterdir())
    assert size <= 15 * 1024 * 1024, f"bundled model is {size} bytes"
    cfg = json.loads((BUNDLED_MODEL_PATH / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert head_dim >= 32 and cfg["hidden_size"] >= 128
    assert 4 <= cfg["num_hidden_layers"] <= 8
    assert cfg["tie_word_embeddings"] is True


def test_setup_fails_clearly_without_python312(tmp_path):
    if any(os.path.exists(p) for p in ("/usr/bin/python3.12", "/usr/local/bin/python3.12")):
        pytest.skip("this machine has a system python3.12")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "VENV": str(tmp_path / "venv"), "CAUSALBOARD_DEVICE": "cpu"}
    proc = subprocess.run(["bash", str(REPO / "scripts/setup_venv.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "needs Python 3.12" in proc.stderr


def test_setup_skips_the_download_only_when_every_pin_has_its_wheel(tmp_path):
    """`scripts/wheels_present.py` (setup_venv.sh skips `pip download`, ~50 s, when it exits 0):
    names compared normalized (`apache-tvm-ffi` is `apache_tvm_ffi-...whl`), versions exactly;
    one pin without its wheel, or with another version's, makes it exit 1."""
    req = tmp_path / "req.txt"
    req.write_text("# pins\napache-tvm-ffi==0.1.15.post2\nPyYAML==6.0.3  # comment\n\nuv==0.13.9\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("apache_tvm_ffi-0.1.15.post2-cp312-abi3-manylinux_2_28_x86_64.whl",
                 "pyyaml-6.0.3-cp312-cp312-manylinux_2_17_x86_64.whl", "uv-0.13.8-py3-none-any.whl"):
        (wheels / name).touch()
    script = [sys.executable, str(REPO / "scripts/wheels_present.py"), str(req), str(wheels)]
    proc = subprocess.run(script, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "uv==0.13.9" in proc.stderr
    (wheels / "uv-0.13.9-py3-none-manylinux_2_17_x86_64.whl").touch()
    assert subprocess.run(script, capture_output=True, text=True, timeout=30).returncode == 0


def test_the_pinned_cpu_list_has_uv_and_setup_falls_back_to_pip():
    """setup_venv.sh installs the CPU list with the uv it pins (~100 s instead of ~4.5 min on the
    2-core development machine) and with pip where uv cannot be installed or fails."""
    pins = (REPO / "requirements/cpu.txt").read_text().splitlines()
    assert [p for p in pins if p.startswith("uv==")] == ["uv==0.13.9"]
    text = (REPO / "scripts/setup_venv.sh").read_text()
    assert '"$VENV/bin/uv" pip install' in text and 'install -q --no-deps --no-index --find-links "$WHEELS" -r "$REQ"' in text


def test_installed_packages_carry_their_bytecode():
    """The environment's packages come with their compiled bytecode, as pip installs them: where
    PYTHONDONTWRITEBYTECODE is set (the CI hosts) nothing writes it later, and every process
    would compile torch's and vLLM's sources at import (a uv install without --compile-bytecode
    made the test run ~50 % slower that way)."""
    import importlib.util

    import torch
    import vllm

    for mod in (vllm, torch):
        cached = importlib.util.cache_from_source(mod.__file__)
        assert os.path.exists(cached), f"{mod.__name__} has no bytecode at {cached}"
