"""The vLLM seam as a map: `PATCHES` is what `install()` applies, `PATCHED_SYMBOLS` is derived
from it and says exactly which vLLM attributes carry causalboard's replacements; and the
scheduler-side KV salt that keeps intervened KV blocks out of other requests' prefix cache."""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest

from engine_ext.program import KV_SALT_KEY, first_modified_position
from engine_ext.worker import seam


def _replaced_attributes() -> set[str]:
    """Every attribute of the modules and classes in the patch table that carries `_cb_wrapped`."""
    found = set()
    for patch in seam.PATCHES:
        try:
            owner = importlib.import_module(patch.module)
        except Exception:
            assert patch.optional, patch.module
            continue
        prefix = patch.module
        if patch.cls:
            owner = getattr(owner, patch.cls)
            prefix = f"{patch.module}.{patch.cls}"
        for name, value in inspect.getmembers(owner):
            if getattr(value, "_cb_wrapped", False) and (patch.cls is None or name in vars(owner)):
                found.add(f"{prefix}.{name}")
    return found


def test_install_patches_exactly_the_listed_symbols():
    seam.install()
    importable = [s for s in seam.PATCHED_SYMBOLS
                  if not any(s in p.symbols and p.optional and not _imports(p.module) for p in seam.PATCHES)]
    assert importable and all(seam.is_patched(s) for s in importable)
    assert _replaced_attributes() == set(importable)
    assert len(set(seam.PATCHED_SYMBOLS)) == len(seam.PATCHED_SYMBOLS)


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


def test_kv_salt_covers_exactly_the_blocks_from_the_first_modified_position():
    seam.install()
    from vllm.v1.core import block_pool, kv_cache_utils

    assert block_pool.generate_block_hash_extra_keys is kv_cache_utils.generate_block_hash_extra_keys
    salted = SimpleNamespace(mm_features=[], lora_request=None, cache_salt=None, prompt_embeds=None,
                             sampling_params=SimpleNamespace(extra_args={KV_SALT_KEY: [20, "cb-salt"]}))
    plain = SimpleNamespace(mm_features=[], lora_request=None, cache_salt=None, prompt_embeds=None,
                            sampling_params=SimpleNamespace(extra_args=None))
    keys = [kv_cache_utils.generate_block_hash_extra_keys(salted, a, a + 16, 0)[0] for a in (0, 16, 32)]
    assert keys == [None, ("cb-salt",), ("cb-salt",)]  # block [0,16) ends before 20: shareable
    assert kv_cache_utils.generate_block_hash_extra_keys(plain, 16, 32, 0)[0] is None


def test_first_modified_position():
    def prog(**parts):
        return {"n_prompt": 10, "steer": [], "patch": [], "noise": None, **parts}

    assert first_modified_position(prog()) is None  # captures only: nothing changes
    assert first_modified_position(prog(patch=[{"dst": [7, 4]}])) == 4
    assert first_modified_position(prog(noise={"pos": [3, 5]})) == 3
    assert first_modified_position(prog(steer=[{"pos": list(range(10)), "gen": True, "phase": "both"}])) == 0
    # decode-only steering leaves the prompt's KV as it is
    assert first_modified_position(prog(steer=[{"pos": list(range(10)), "gen": True, "phase": "decode"}])) == 10
    assert first_modified_position(prog(steer=[{"pos": [2], "gen": False, "phase": "prefill"}])) == 2


def test_a_hybrid_whose_module_does_not_import_is_refused_by_name(monkeypatch):
    """Dense models never need a hybrid's extra packages: the hybrid's module is patched only
    where it imports, and such a model is then refused naming why (not a crash at install)."""
    from engine_ext.worker import seam

    monkeypatch.setitem(seam.SKIPPED_MODULES, "vllm.model_executor.models.qwen3_next",
                        "ModuleNotFoundError: No module named 'compressed_tensors'")
    assert "compressed_tensors" in seam.unavailable_architecture("Qwen3NextForCausalLM")
    assert seam.unavailable_architecture("LlamaForCausalLM") is None


def test_the_v2_runner_launches_the_forward_after_prepare_forward():
    """A V2 step with dynamic steering is finished at `EPLBController.prepare_forward`
    (`seam._v2_defers`): that relies on the V2 `execute_model` calling `prepare_inputs`, then its
    attention preparation, then `self.eplb.prepare_forward`, then the forward, which the source
    hash pins; the installed vLLM's source has that hash and that order."""
    import hashlib
    import textwrap

    seam.install()
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert seam._v2_defers(GPUModelRunner)
    fn = GPUModelRunner.execute_model.__wrapped__
    src = textwrap.dedent(inspect.getsource(fn))
    assert hashlib.sha256(src.encode()).hexdigest()[:16] == seam.V2_EXECUTE_MODEL_SHA
    order = [src.index(s) for s in ("self.prepare_inputs(", "self.model_state.prepare_attn(",
                                    "self.eplb.prepare_forward(", "self.cudagraph_manager.run_fullgraph(")]
    assert order == sorted(order) and src.count("self.eplb.prepare_forward(") == 1
    assert seam.is_patched("vllm.v1.worker.gpu.eplb_utils.EPLBController.prepare_forward")


def test_execute_model_closes_a_step_left_open_when_vllm_raises():
    """A V2 step left open by `prepare_inputs` whose `execute_model` raises before the forward:
    the wrapper closes it (`finish_step`) and drops the controller's mark, then re-raises; a
    step that completes gets `after_forward` only."""
    calls = []

    class State:
        segmented: dict = {}  # no segmented requests (WorkerState's)
        step_scores: list = []

        def on_schedule(self, so):
            calls.append("schedule")

        def finish_step(self):
            calls.append("finish")

        def after_forward(self):
            calls.append("after")

    class Eplb:
        pass

    class Runner:
        def execute_model(self, scheduler_output):
            self.eplb._cb_open = self._cb_state_obj
            if scheduler_output == "boom":
                raise RuntimeError("boom")
            vars(self.eplb).pop("_cb_open")
            return "out"

    seam._wrap_execute_model(Runner)
    r = Runner()
    r._cb_state_obj, r.eplb = State(), Eplb()
    assert r.execute_model("ok") == "out" and calls == ["schedule", "after"]
    calls.clear()
    with pytest.raises(RuntimeError, match="boom"):
        r.execute_model("boom")
    assert calls == ["schedule", "finish"] and "_cb_open" not in vars(r.eplb)


def test_prepare_forward_finishes_the_step_left_open_once_and_before_vllms_own():
    """The V2 hook's contract, on a stand-in controller: the step `prepare_inputs` left open
    (`_cb_open`) is finished before vLLM's `prepare_forward` body runs, once; a controller with
    no open step only runs vLLM's body."""
    calls = []

    class Controller:
        def prepare_forward(self, model_config, num_tokens):
            calls.append(("vllm", num_tokens))

    class State:
        def finish_step(self):
            calls.append(("finish",))

    seam._wrap_v2_prepare_forward(Controller)
    ctl = Controller()
    ctl._cb_open = State()
    ctl.prepare_forward(None, 7)
    ctl.prepare_forward(None, 8)
    assert calls == [("finish",), ("vllm", 7), ("vllm", 8)]
    assert "_cb_open" not in vars(ctl)


def test_the_engine_core_gains_one_utility_and_the_replicated_send_is_the_checked_one():
    """`install_core_utilities` adds `cb_add_requests` to vLLM's engine core (nothing else of it
    changes), and the client method a batch replaces is the source causalboard checked."""
    import hashlib
    import textwrap

    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.engine.core_client import SyncMPClient

    before = {k: v for k, v in vars(EngineCoreProc).items() if k != seam.ADD_REQUESTS_UTILITY}
    seam.install()
    seam.install_core_utilities()
    assert getattr(EngineCoreProc, seam.ADD_REQUESTS_UTILITY) is seam._core_add_requests
    assert {k: v for k, v in vars(EngineCoreProc).items() if k != seam.ADD_REQUESTS_UTILITY} == before
    src = textwrap.dedent(inspect.getsource(SyncMPClient.add_request))
    assert hashlib.sha256(src.encode()).hexdigest()[:16] == seam.SYNC_ADD_REQUEST_SHA


def test_the_output_wait_the_loop_wakes_is_the_checked_one():
    """`wake_output_wait` relies on `SyncMPClient.get_output` waiting on `outputs_queue` alone
    (the source causalboard checked), and vLLM's `LLMEngine.step` returns no outputs for the
    empty `EngineCoreOutputs` it puts there."""
    import hashlib
    import queue
    import textwrap
    import types

    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.core_client import SyncMPClient
    from vllm.v1.engine.llm_engine import LLMEngine

    src = textwrap.dedent(inspect.getsource(SyncMPClient.get_output))
    assert hashlib.sha256(src.encode()).hexdigest()[:16] == seam.SYNC_GET_OUTPUT_SHA
    assert "self.outputs_queue.get()" in src
    client = SyncMPClient.__new__(SyncMPClient)
    client.outputs_queue = queue.Queue()
    client.engines_running = True
    engine = types.SimpleNamespace(engine_core=client)
    seam.wake_output_wait(engine)
    got = SyncMPClient.get_output(client)
    assert isinstance(got, EngineCoreOutputs) and got.outputs == []
    # vLLM's step over it: nothing processed, nothing returned, nothing sent
    sent = []
    client.abort_requests = lambda ids: sent.append(ids) if ids else None
    processed = types.SimpleNamespace(request_outputs=[], reqs_to_abort=[])
    fake = types.SimpleNamespace(
        should_execute_dummy_batch=False, engine_core=client, log_stats=False, logger_manager=None,
        output_processor=types.SimpleNamespace(process_outputs=lambda outs, **k: processed if outs == [] else None,
                                               update_scheduler_stats=lambda stats: None))
    seam.wake_output_wait(engine)
    assert LLMEngine.step(fake) == [] and sent == []
