"""Resolved by vLLM inside every worker (`worker_extension_cls`) before the model is built:
importing it installs causalboard's patches there (see `seam`)."""

from .seam import CausalboardWorkerExtension, install

install()

__all__ = ["CausalboardWorkerExtension"]
