"""The GPU build of the kernels, checked without a GPU: compile for sm_90 through ptxas (a
subprocess, since this session may run Triton's interpreter), and import without triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _run(code_or_script: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *code_or_script], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    probe = _run(["-c", "from triton.compiler import ASTSource; from triton.backends.compiler import GPUTarget"], env)
    if probe.returncode:
        pytest.skip(f"this triton has no usable AOT compiler entry points: {probe.stderr.strip()[-200:]}")
    result = _run([str(HERE / "sm90_compile.py"), "--quick"], env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert " 0 failed" in result.stdout


def test_tokenmill_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import tokenmill\n"
        "from tokenmill.layers.attention.triton_backend import TritonAttentionBackend\n"
        "from tokenmill.errors import ConfigError\n"
        "from tokenmill.layers.moe import SparseMoeBlock\n"
        "try:\n    TritonAttentionBackend()\nexcept ConfigError as e:\n    print('refused:', e)\n"
        "from tokenmill.layers.attention.mla import MLAAttention\n"
        "from tokenmill.layers.attention.mla_backends import mla_backend\n"
        "mla_backend('torch')\n"
        "try:\n    mla_backend('triton')\nexcept ConfigError as e:\n    print('MLA refused:', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = _run(["-c", code], env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: --attention-backend triton needs triton" in result.stdout
    assert "MLA refused: --attention-backend triton needs triton" in result.stdout
