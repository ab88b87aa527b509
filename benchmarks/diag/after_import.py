"""Patch a module right after it is executed, whenever it is first imported (for the diagnostic
`sitecustomize` folders `steptimes/` and `no_site_ops/`, which patch vLLM's and causalboard's
modules in every process, vLLM's spawned engine core included, without changing their code).
Each loads it by its file path, so the folders need nothing else on `sys.path`."""

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


def patch_after_import(targets: dict[str, Callable[[ModuleType], None]]) -> None:
    """After each module named in `targets` is executed, call its patch with the module."""

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name not in targets:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module, _run=run, _name=name):
                _run(module)
                targets[_name](module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AfterImport())

