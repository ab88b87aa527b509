"""The foundation's packaging contracts: plugin registration, version refusal, the bundled model."""

import json
import os
import subprocess
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
