"""The GIL's switch interval of every Python process started with this folder first on PYTHONPATH
and `CB_SWITCH_INTERVAL` set (seconds; CPython's default is 0.005), for A/B runs of a server whose
threads compete for the GIL (issue 13: `causalboard serve`'s event-loop and engine-loop threads
during P1 over HTTP; docs/performance.md, "Nineteenth session"):

    PYTHONPATH=benchmarks/diag/switchinterval:$PYTHONPATH \\
        TASKS=p1 CB_ENVS="default CB_SWITCH_INTERVAL=0.0005" bash benchmarks/gpu_http_call.sh

Without the variable nothing changes. (Python imports one `sitecustomize`: not together with
`benchmarks/diag/servetimes`.)"""
import os
import sys

if os.environ.get("CB_SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["CB_SWITCH_INTERVAL"]))
