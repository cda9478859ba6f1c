"""benchmarks/sass_loop.py: the main loop found in a disassembly (the longest backward branch's body,
predicated instructions included), and a real sm_90 variant counted per weight element."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from sass_loop import main_loop, opcode  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/              @!P0 IMAD.SHL.U32 R3, R2, 0x40, RZ ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R12, R14, R8 ;
        /*0040*/               @P1 BRA `(.L_x_0) ;
.L_x_1:
        /*0050*/                   FADD R1, R1, R2 ;
        /*0060*/                   BRA `(.L_x_1) ;
        /*0070*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0080*/                   EXIT ;
"""


def test_the_longest_backward_branch_is_the_loop() -> None:
    loop = main_loop(SASS)
    assert [opcode(text) for text in loop] == ["LDG", "IMAD", "HMMA", "BRA"]
    assert main_loop("        /*0000*/                   EXIT ;\n") == []


def test_a_compiled_variant_is_counted_per_weight_element() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_loop.py"), "gemv o 4096x4096 fp8 mx32 rows=1"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith("| gemv o 4096x4096 fp8 mx32 rows=1"))
    instructions, per_element = (cell.strip() for cell in row.split("|")[2:4])
    assert int(instructions) > 0 and 0.5 < float(per_element) < 100
    assert re.search(r"FFMA \d+", row)  # the fp32 dot of a one-row gemv
