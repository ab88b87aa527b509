"""`causalboard` command line.

    causalboard serve                 # API on http://127.0.0.1:8000 (HOST, PORT, MODEL env override)
    causalboard generate "The capital of Tarn is" --max-tokens 4
    causalboard sweep --prompt "Garrow is ruled by" --clean-prompt "Guzar is ruled by" \
        --answer " Hadrian" --metric recovered --out trace.npz --figure trace.pdf
    causalboard export trace.npz --out figures/ --formats pdf,png,csv
    causalboard state-check --model ./my-hybrid    # recurrent-state hygiene of a hybrid (docs/hybrid-models.md)
    causalboard version

`sweep` and `export` talk to a running server (`--url`, env CAUSALBOARD_URL); see `causalboard
sweep --help` and app/cli/sweep.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys


def _engine_config(args: argparse.Namespace):
    from engine_ext import EngineConfig

    return EngineConfig(
        model=args.model or None,
        device=args.device,
        enforce_eager=args.eager,
        max_model_len=args.max_model_len,
        batch_invariant=args.batch_invariant,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        multiprocess=args.multiprocess,
        cpu_threads=args.cpu_threads,
        **({"source_store_bytes": int(args.source_store_mb * 1024 * 1024)} if args.source_store_mb is not None else {}),
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("MODEL"), help="local HF model folder (default: the bundled model; env MODEL)")
    p.add_argument("--device", default=os.environ.get("DEVICE", "auto"), choices=["auto", "cpu", "cuda"])
    eager = p.add_mutually_exclusive_group()
    eager.add_argument("--eager", dest="eager", action="store_true", default=None, help="force enforce_eager")
    eager.add_argument("--compiled", dest="eager", action="store_false", help="torch.compile (+ CUDA graphs on GPU)")
    p.add_argument("--max-model-len", type=int, default=None)
    bi = p.add_mutually_exclusive_group()
    bi.add_argument("--batch-invariant", dest="batch_invariant", action="store_true", default=None,
                    help="batch invariance (the default): a request's numbers do not depend on its batch, so sweep cells "
                         "equal their solo runs (GPU: vLLM's batch-invariant kernels, slower decoding; CPU: row-invariant "
                         "linear layers where the host's GEMM is not, e.g. AVX2; docs/validation.md)")
    bi.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                    help="the kernels as vLLM picks them (faster; sweep cells then may vary with their batch)")
    p.add_argument("--source-store-mb", type=float, default=None,
                   help="byte budget of the stored source runs (keep_as), in MiB (default 256); the least recently used "
                        "unleased runs are evicted beyond it")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU: the forward's threads (default: OMP_NUM_THREADS, else one fewer than the cores, so that "
                        "other work on the machine cannot stall it; docs/performance.md)")
    mp = p.add_mutually_exclusive_group()
    mp.add_argument("--multiprocess", dest="multiprocess", action="store_true", default=None,
                    help="run vLLM's engine core in its own process (default: off on CPU, vLLM's default on GPU)")
    mp.add_argument("--no-multiprocess", dest="multiprocess", action="store_false", help="engine core in this process (on a GPU also set VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's default, on, wins)")
    par = p.add_argument_group("parallelism (vLLM's flags; docs/distributed.md)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks per pipeline stage")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages")
    par.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray", "uni", "external_launcher"],
                     help="how the ranks run (default: vLLM's choice; 'ray' for several nodes; CPU: 'mp' only)")


#: the server process's youngest-generation collection threshold (CPython's default: 700); env
#: CAUSALBOARD_GC_THRESHOLD overrides it (700 restores CPython's)
SERVER_GC_THRESHOLD = 20_000


def apply_server_gc_threshold(environ=os.environ) -> int:
    """Set this process's youngest-generation garbage-collection threshold for serving and return
    it: `CAUSALBOARD_GC_THRESHOLD`, else `SERVER_GC_THRESHOLD`. A 768-cell sweep allocates enough
    short-lived containers for ~28 young collections at CPython's 700 (6-8 ms of pauses on the
    2-core CPU, on the API's threads); at 20,000 about one (1.4-1.9 ms). The startup heap is frozen
    (`Engine.start`), so a collection walks only what serving allocated. Raises ValueError naming
    the variable for anything but a whole number >= 1 (0 would turn automatic collection off)."""
    import gc

    raw = environ.get("CAUSALBOARD_GC_THRESHOLD", "").strip()
    try:
        value = int(raw) if raw else SERVER_GC_THRESHOLD
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"CAUSALBOARD_GC_THRESHOLD must be a whole number >= 1 (700 is CPython's default), got {raw!r}")
    gc.set_threshold(value, *gc.get_threshold()[1:])
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.api.app import create_app

    try:
        apply_server_gc_threshold()
    except ValueError as e:
        print(f"causalboard: {e}", file=sys.stderr, flush=True)
        return 2
    app = create_app(config=_engine_config(args), api_key=args.api_key, capture_dir=args.capture_dir,
                     capture_log=args.capture_log, dashboard=args.dashboard)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10)
    # Bind the port before the engine starts (seconds to minutes): a port in use fails at once,
    # `--port 0` gets a free port that is announced, and nothing else on the host — vLLM's own
    # distributed-init ports included — can take the port while the engine loads. Connections are
    # refused (not accepted) until the engine is ready. Forked engine processes drop their copy.
    try:
        sock = config.bind_socket()  # logs the OSError, then exits
    except SystemExit:
        print(f"causalboard: cannot serve on {args.host}:{args.port} (see the error above); the engine was not started",
              file=sys.stderr, flush=True)
        return 1
    os.register_at_fork(after_in_child=sock.close)
    host = f"[{args.host}]" if ":" in args.host else args.host
    app.state.announce = f"http://{host}:{sock.getsockname()[1]}"
    print(f"causalboard: starting the engine, then serving on {app.state.announce}", flush=True)
    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown (the lifespan then closes the engine)
    # and afterwards re-raises the signal to the handler that was installed before it: make that
    # a clean exit, so a stopped server reports success.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    server = uvicorn.Server(config)
    # the engine died (docs/reliability.md): stop serving once the in-flight requests got their
    # 503s, and exit 1 so a supervisor restarts the server (as `vllm serve` does)
    app.state.on_engine_death = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    if not server.started:  # the engine (or the socket) failed at start-up
        return 1
    failure = app.state.engine.failure
    if failure is not None:
        print(f"causalboard: the vLLM engine died ({failure}); exiting with status 1 so a supervisor restarts "
              "the server (stored source runs are lost; clients retry)", file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from engine_ext import Engine, GenerationParams

    with Engine(_engine_config(args)) as eng:
        gen = eng.generate(args.prompt, GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, logprobs=args.logprobs))
    print(json.dumps(gen.to_dict(), indent=2))
    return 0


def cmd_version(_: argparse.Namespace) -> int:
    from importlib import metadata

    from engine_ext.worker.seam import VLLM_VERSION_CHECKED, installed_vllm_version

    try:
        own = metadata.version("causalboard")
    except metadata.PackageNotFoundError:
        own = "source"
    print(json.dumps({"causalboard": own, "vllm": installed_vllm_version(), "vllm_checked": VLLM_VERSION_CHECKED}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="causalboard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the HTTP API")
    serve.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")),
                       help="TCP port, bound before the engine starts (0: a free one, printed at start-up)")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on mutating endpoints (env CAUSALBOARD_API_KEY)")
    serve.add_argument("--capture-dir", default=None,
                       help="enable the reference fork's filesystem capture consumer, writing under this directory "
                            "(env CAUSALBOARD_CAPTURE_DIR)")
    serve.add_argument("--capture-log", default=None, metavar="JSON",
                       help="enable the reference fork's server-wide logging capture consumer: one log line per "
                            "capture key of every completion; JSON {\"hooks\": {hook: [layers] | \"all\"}, "
                            "\"positions\"?, \"level\"?} (env CAUSALBOARD_CAPTURE_LOG)")
    serve.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                       help="serve the API only: no dashboard at /dashboard, Panel not imported")
    _add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate once and print JSON")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--logprobs", type=int, default=0)
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    from app.cli.sweep import add_parsers as add_sweep_parsers

    add_sweep_parsers(sub)

    from app.cli.state_check import add_parsers as add_state_check_parsers

    add_state_check_parsers(sub)

    ver = sub.add_parser("version", help="print versions")
    ver.set_defaults(func=cmd_version)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clear one-line error instead of a traceback for bad options
        from engine_ext.errors import SpecError

        if isinstance(exc, SpecError):
            print(f"causalboard: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
