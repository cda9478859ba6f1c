"""The structure of `tokenmill serve`'s start-up on the CPU default model, guarded without timing
anything (benchmarks/startup_profile.py measures it): in a fresh interpreter, the server is built
with the GGUF header parsed once, no AutoTokenizer legacy parse of the whole file, no model built
on the meta device to size it, no default weight initialisation, no CUDA graphs, no Triton or
torch.compile machinery imported, and garbage collection back on once start-up has frozen what it
built."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tokenmill.kv.specs import zeros
from tokenmill.quantization.base import default_uniform_, embedding, weights_filled_later

SCRIPT = r"""
import gc, json, socket, sys
import torch
import transformers.modeling_gguf_pytorch_utils as legacy
import tokenmill.models.gguf_file as gguf_file
import tokenmill.quantization.base as base
import tokenmill.runner.model_builder as builder

seen = {"gguf_parses": 0, "constructs": [], "default_inits": 0}
parse = gguf_file.GGUFCheckpoint.__init__
def counted_parse(self, path):
    seen["gguf_parses"] += 1
    parse(self, path)
gguf_file.GGUFCheckpoint.__init__ = counted_parse
def refuse(*args, **kwargs):
    raise AssertionError("AutoTokenizer parsed the whole GGUF for a config")
legacy.load_gguf_checkpoint = refuse
construct = builder._construct
def recorded_construct(build, dtype, device):
    seen["constructs"].append((str(device), base._DEFAULT_INIT.get()))
    return construct(build, dtype, device)
builder._construct = recorded_construct
uniform = torch.Tensor.uniform_
def counted_uniform(self, *args, **kwargs):
    seen["default_inits"] += 1
    return uniform(self, *args, **kwargs)
torch.Tensor.uniform_ = counted_uniform

from tokenmill.cli import build_parser
from tokenmill.server import serve

args = build_parser().parse_args(["serve", "--port", "0", "--max-model-len", "256", "--kv-cache-bytes", "64M"])
assert args.gc_off_until_ready
gc.disable()
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
server = serve.build_server(args, sock)
engine = server.state.engine.engine  # the AsyncEngine's LLMEngine
seen["gc_enabled"] = gc.isenabled()
seen["modules"] = sorted(m for m in ("triton", "torch._dynamo", "torch._inductor") if m in sys.modules)
seen["graphs"] = len(engine.runner.graphs)
print("RESULT " + json.dumps(seen))
"""


@pytest.mark.slow
def test_cpu_serve_start_up_does_each_thing_once_and_nothing_it_does_not_need() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    seen = json.loads(lines[0].removeprefix("RESULT "))
    assert seen["gguf_parses"] == 1
    assert seen["constructs"] == [["cpu", False]]  # once, on the CPU, without default initialisation
    assert seen["default_inits"] == 0
    assert seen["modules"] == []
    assert seen["graphs"] == 0
    assert seen["gc_enabled"] is True


def test_default_initialisation_is_skipped_only_inside_the_context() -> None:
    w = torch.full((4, 4), 7.0)
    assert default_uniform_(w, 0.5).abs().max() <= 0.5
    with weights_filled_later():
        w.fill_(7.0)
        assert torch.equal(default_uniform_(w, 0.5), torch.full((4, 4), 7.0))
        assert embedding(5, 3).weight.shape == (5, 3)
    torch.manual_seed(0)
    assert embedding(50, 8).weight.std() > 0.5  # N(0, 1) again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64])
def test_cpu_cache_memory_is_zeroed_and_writable(dtype: torch.dtype) -> None:
    cache = zeros((3, 4, 5), dtype, "cpu")
    assert cache.shape == (3, 4, 5) and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.float().any()
    cache[1, 2, 3] = 1
    assert cache.float().sum() == 1
    assert zeros((0, 4), dtype, "cpu").shape == (0, 4)
