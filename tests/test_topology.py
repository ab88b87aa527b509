"""Merging the replies of several workers (`engine_ext.engine.topology`), the CPU thread binding,
the serve flags and how the dashboard shows a topology. Pure Python: no engine."""

from __future__ import annotations

import pytest

from engine_ext.engine.topology import (Topology, cpu_thread_binding, merge_model_info, merge_results, merge_store_info,
                                        merge_store_usage)


def _info(tp, pp, first, end, **kw):
    return {"tp_rank": tp, "pp_rank": pp, "first_layer": first, "end_layer": end, "num_layers": 8, "patched_layers": end - first,
            "embedding_std": 0.5 if pp == 0 else None, "buffer_bytes": 10, **kw}


TP2 = [_info(0, 0, 0, 8), _info(1, 0, 0, 8)]
PP2 = [_info(0, 0, 0, 4), _info(0, 1, 4, 8)]
TP2PP2 = [_info(0, 0, 0, 4), _info(1, 0, 0, 4), _info(0, 1, 4, 8), _info(1, 1, 4, 8)]


def test_topology_from_worker_infos():
    assert Topology.of(TP2).to_json() == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                                          "stages": [{"pp_rank": 0, "layers": [0, 7], "tp_ranks": [0, 1]}]}
    pp = Topology.of(PP2)
    assert pp.world_size == 2 and pp.leaders == (0, 1)
    assert [s["layers"] for s in pp.to_json()["stages"]] == [[0, 3], [4, 7]]
    both = Topology.of(list(reversed(TP2PP2)))  # reply order does not matter
    assert (both.tensor_parallel_size, both.pipeline_parallel_size, both.leaders) == (2, 2, (3, 1))  # the tp0 rank of each stage, by reply index


def test_model_info_counts_each_stage_once():
    assert merge_model_info(TP2, Topology.of(TP2))["patched_layers"] == 8
    merged = merge_model_info(PP2, Topology.of(PP2))
    assert merged["patched_layers"] == 8 and merged["embedding_std"] == 0.5 and merged["buffer_bytes"] == 20


def _block(keys, data):
    return {"keys": keys, "data": data}


def test_results_merge_captures_of_every_stage_and_void_on_any_stage():
    topo = Topology.of(PP2)
    ok0 = {"r": {"key": "r", "status": "ok", "errors": [], "captures": _block([[0, 1]], b"ab"), "stored_as": "run"}}
    ok1 = {"r": {"key": "r", "status": "ok", "errors": [], "captures": _block([[5, 1]], b"cd"), "stored_as": "run",
                 "evicted": ["old"]}}
    merged = merge_results([ok0, ok1], topo)["r"]
    assert merged["status"] == "ok" and merged["captures"] == {"keys": [[0, 1], [5, 1]], "data": b"abcd"}
    assert isinstance(merged["captures"]["data"], bytearray), "joined once into a writable buffer (not copied again)"
    assert merged["stored_as"] == "run" and merged["evicted"] == ["old"]
    void1 = {"r": {"key": "r", "status": "voided", "errors": ["source run 'x' is not stored"]}}
    merged = merge_results([ok0, void1], topo)["r"]
    assert merged["status"] == "voided" and merged["errors"] == ["source run 'x' is not stored"]
    # stored on one stage only (the other could not fit it): not reported as stored
    partial = {"r": {**ok1["r"], "stored_as": None, "store_error": "full"}}
    merged = merge_results([ok0, partial], topo)["r"]
    assert "stored_as" not in merged and merged["store_error"] == "full"


def test_results_of_tensor_parallel_ranks_come_from_the_leader():
    topo = Topology.of(TP2)
    a = {"r": {"key": "r", "status": "ok", "errors": [], "captures": _block([[0, 0]], b"xy")}}
    b = {"r": {"key": "r", "status": "ok", "errors": [], "captures": _block([[0, 0]], b"xy")}}
    assert merge_results([a, b], topo)["r"]["captures"] == {"keys": [[0, 0]], "data": b"xy"}
    assert merge_results([a, b], topo)["r"]["captures"] is a["r"]["captures"], "the leader's block as it is (no copy)"


def test_store_is_reported_as_one_store():
    topo = Topology.of(PP2)
    assert merge_store_info([{"sites": [0], "positions": [1], "bytes": 4, "leases": 1}, None], topo) is None
    info = merge_store_info([{"sites": [0], "positions": [1], "bytes": 4, "leases": 1},
                             {"sites": [15], "positions": [1, 2], "bytes": 6, "leases": 0}], topo)
    assert info == {"sites": [0, 15], "positions": [1, 2], "bytes": 10, "leases": 0}
    # every stage charges the whole run (10 bytes) against its own budget
    u0 = {"budget_bytes": 100, "used_bytes": 10, "evictions": 1, "runs": [{"run_id": "a", "bytes": 4, "values": 1, "leases": 0}]}
    u1 = {"budget_bytes": 100, "used_bytes": 10, "evictions": 2, "runs": [{"run_id": "a", "bytes": 6, "values": 2, "leases": 0}]}
    assert merge_store_usage([u0, u1], topo) == {"budget_bytes": 100, "used_bytes": 10, "evictions": 2,
                                                 "runs": [{"run_id": "a", "bytes": 10, "values": 3, "leases": 0}]}


def test_cpu_thread_binding_gives_each_rank_its_own_cores():
    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [4, 5, 6, 7]) == "4-5|6-7"
    assert cpu_thread_binding(2, [0, 2, 4, 8]) == "0,2|4,8"
    assert cpu_thread_binding(3, [0, 1, 2, 3]) == "0|1|2"
    with pytest.raises(ValueError, match="at least 4 CPU cores"):
        cpu_thread_binding(4, [0, 1])


def test_serve_flags_reach_the_engine_config():
    from app.cli.main import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2", "-pp", "2", "--distributed-executor-backend", "ray"])
    cfg = _engine_config(args)
    assert (cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.distributed_executor_backend) == (2, 2, "ray")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--distributed-executor-backend", "nccl"])


def test_dashboard_header_shows_the_topology():
    from app.dashboard.app import header_html, topology_text

    topo = {"tensor_parallel_size": 1, "pipeline_parallel_size": 2,
            "stages": [{"pp_rank": 0, "layers": [0, 3], "tp_ranks": [0]}, {"pp_rank": 1, "layers": [4, 7], "tp_ranks": [0]}]}
    assert topology_text(topo) == "TP 1 x PP 2 (stage 0: layers 0-3, stage 1: layers 4-7)"
    assert topology_text({"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "stages": []}) == ""
    html = header_html({"status": "ok", "model": "m", "topology": topo}, "http://x")
    assert 'data-cb="topology">TP 1 x PP 2' in html
    assert "topology" not in header_html({"status": "ok", "model": "m"}, "http://x")


# ---- refused before anything starts ----------------------------------------------------------------
def _engine(**kw):
    from engine_ext import Engine

    return Engine(device="cpu", **kw)  # constructed, not started


def test_parallel_settings_are_checked_before_start(monkeypatch):
    from engine_ext import SpecError

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with pytest.raises(SpecError) as err:
        _engine(tensor_parallel_size=0)._parallel_kwargs()
    assert err.value.field == "tensor_parallel_size"
    with pytest.raises(SpecError) as err:
        _engine(tensor_parallel_size=2, distributed_executor_backend="ray")._parallel_kwargs()
    assert err.value.field == "distributed_executor_backend" and "Ray" in str(err.value)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1})
    with pytest.raises(SpecError) as err:
        _engine(tensor_parallel_size=2, pipeline_parallel_size=2)._parallel_kwargs()
    assert err.value.field == "tensor_parallel_size" and "4 ranks" in str(err.value)
    kwargs, env = _engine(pipeline_parallel_size=2)._parallel_kwargs()
    assert kwargs == {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # the user's own binding wins
    assert _engine(tensor_parallel_size=2)._parallel_kwargs()[1] == {}


def test_gpu_tensor_parallel_turns_off_passes_that_split_the_stream():
    from engine_ext import SpecError

    eng = _engine(tensor_parallel_size=2)
    eng.device = "cuda"  # the GPU branch of the settings, without a GPU
    kwargs, env = eng._parallel_kwargs()
    assert kwargs["compilation_config"]["pass_config"] == {"enable_sp": False, "fuse_gemm_comms": False, "fuse_allreduce_rms": False}
    assert env == {}
    asked = _engine(tensor_parallel_size=2, engine_kwargs={"compilation_config": {"pass_config": {"enable_sp": True}}})
    asked.device = "cuda"
    with pytest.raises(SpecError) as err:
        asked._parallel_kwargs()
    assert err.value.field == "engine_kwargs" and "enable_sp" in str(err.value)


def test_a_topology_the_seam_does_not_cover_is_refused():
    eng = _engine(pipeline_parallel_size=2)
    half = [_info(0, 0, 0, 4), {**_info(0, 1, 4, 8), "patched_layers": 3}]  # one layer not patched
    eng._topology = Topology.of(half)
    with pytest.raises(RuntimeError, match="patched 7 of 8 decoder layers"):
        eng._check_topology(half, 8)
    gap = [_info(0, 0, 0, 4), _info(0, 1, 5, 8)]
    eng._topology = Topology.of(gap)
    with pytest.raises(RuntimeError):
        eng._check_topology(gap, 8)
