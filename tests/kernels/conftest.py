"""Kernel tests run on CUDA when there is one, else on CPU under Triton's interpreter.

TRITON_INTERPRET must be set before any kernel module is decorated, so it is set here, at
collection, before a test module imports tokenmill.kernels. Without triton nothing is collected.
"""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["test_*.py"]
