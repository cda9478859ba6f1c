"""Instructions in a kernel's main loop, counted in its sm_90 machine code on any machine (no GPU):
the variants tests/kernels/sm90_compile.py compiles, each disassembled by the nvdisasm in Triton's
wheel. The main loop is the longest backward branch; for a kernel with BLOCK_N and BLOCK_K (the
weight-streaming ones) the count is also given per weight element a loop iteration decodes,
counting every thread: a kernel that decodes weights in registers is bound by this figure before
it is bound by memory (an H200 issues about 33 T thread-instructions per second).

    python benchmarks/sass_loop.py nvfp4 "few_row_mma"     # labels containing any of these
    python benchmarks/sass_loop.py nvfp4 --top 12           # and the commonest opcodes
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

KERNEL_TESTS = Path(__file__).resolve().parents[1] / "tests" / "kernels"
LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


def disassemble(kernel) -> str:
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([nvdisasm, "-c", cubin.name], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (empty for a kernel without a loop)."""
    instructions: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        if found := LABEL.match(line):
            pending.append(found.group(1))
        elif found := LINE.match(line):
            address = int(found.group(1), 16)
            for label in pending:
                labels[label] = address
            pending = []
            instructions.append((address, found.group(2)))
    span = (0, -1)
    for address, text in instructions:
        if (found := BRANCH.search(text)) and labels.get(found.group(1), address) < address:
            start = labels[found.group(1)]
            if address - start > span[1] - span[0]:
                span = (start, address)
    return [text for address, text in instructions if span[0] <= address <= span[1]]


def opcode(text: str) -> str:
    words = text.split()
    if words and words[0].startswith("@"):  # a predicate guard
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("labels", nargs="+", help="report the variants whose label contains any of these")
    parser.add_argument("--top", type=int, default=8, help="commonest opcodes to list per variant")
    args = parser.parse_args()
    # sm90_compile compiles for sm_90 with the interpreter off (it sets TRITON_INTERPRET=0 as it loads)
    sys.path.insert(0, str(KERNEL_TESTS))
    from sm90_compile import (
        attention_variants,
        compile_variant,
        fp8_variants,
        gdn_variants,
        mla_variants,
        moe_variants,
        nvfp4_variants,
        other_variants,
        qsa_variants,
    )

    variants = [*attention_variants(), *other_variants(), *moe_variants(), *mla_variants(), *gdn_variants(),
                *qsa_variants(), *fp8_variants(), *nvfp4_variants()]
    chosen = [v for v in variants if any(text in v[0] for text in args.labels)]
    if not chosen:
        parser.error(f"no variant's label contains any of {args.labels}")
    print("| variant | loop instructions per thread | per weight element | commonest |\n|---|---:|---:|---|")
    for label, fn, types, consts, warps, stages in chosen:
        loop = main_loop(disassemble(compile_variant(fn, types, consts, warps, stages)))
        counts = collections.Counter(opcode(text) for text in loop)
        elements = consts.get("BLOCK_N", 0) * consts.get("BLOCK_K", 0)
        per_element = f"{len(loop) * 32 * warps / elements:.2f}" if elements and loop else ""
        common = ", ".join(f"{name} {n}" for name, n in counts.most_common(args.top))
        print(f"| {label} | {len(loop)} | {per_element} | {common} |", flush=True)


if __name__ == "__main__":
    main()
