"""The float kernel's 1-8-row loops as the compiler emits them (layers/fmatmul_avx512.cpp's row_groups).

Twice a change around ``tile_segment`` left its sums in memory without changing a bit of its results: GCC kept the
array of sums on the stack and stored every one back at every input (out of line before 8761fd4; inlined, at 3, 5,
6 and 7 rows, until its loops were unrolled by pragma), and a beam-5 step's products ran 0.7x as fast. The tests
on bits cannot see that, so this one reads the assembly: the file compiled with the extension's flags
(layers/kernels.py), every innermost loop of row_groups that does the multiply-adds must keep its sums in
registers (no 512-bit register stored to the stack)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fastdecode.layers import kernels

SOURCE = Path(kernels.__file__).with_name("fmatmul_avx512.cpp")
STACK_STORE = re.compile(r"vmov\w*\s+%zmm\d+,\s*-?\w*\(%r[sb]p\)")  # a 512-bit register stored to the stack


def assembly(tmp_path: Path) -> str:
    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = tmp_path / "fmatmul_avx512.s"
    done = subprocess.run([compiler, *kernels.CFLAGS, f"-I{SOURCE.parent}", "-S", str(SOURCE), "-o", str(out)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"the compiler cannot build the AVX-512 file here: {done.stderr[-300:]}")
    return out.read_text()


def row_group_loops(text: str) -> list[tuple[int, int]]:
    """(multiply-adds, 512-bit stack stores) of each loop of row_groups' instances of at most 90 instructions (the
    inner loops over k: a backward jump to a label of the same function)."""
    functions: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        start = re.match(r"^(_Z\S*row_groups\S*):$", line)
        if start:
            current = start.group(1)
            functions[current] = []
        elif current and line.startswith(".cfi_endproc"):
            current = None
        elif current:
            functions[current].append(line)
    loops = []
    for lines in functions.values():
        labels = {line[:-1]: i for i, line in enumerate(lines) if re.match(r"^\.L\w+:$", line)}
        for i, line in enumerate(lines):
            jump = re.match(r"^j\w+\s+(\.L\w+)$", line)
            if jump and labels.get(jump.group(1), i) < i:
                body = [x for x in lines[labels[jump.group(1)] : i + 1] if x and not x.startswith(".")]
                if len(body) <= 90:
                    loops.append((sum(x.startswith("vfmadd") for x in body), sum(bool(STACK_STORE.match(x)) for x in body)))
    return loops


def test_the_1_to_8_row_loops_keep_their_sums_in_registers(tmp_path):
    loops = row_group_loops(assembly(tmp_path))
    # every row count's inner loop is there (3 multiply-adds per row: 1-8 rows of 48 columns), for both weight types
    assert {fmas for fmas, _ in loops} >= {3 * rows for rows in range(1, 9)}, sorted(loops)
    spilling = sorted({(fmas // 3, stores) for fmas, stores in loops if fmas >= 3 and stores > 0})
    assert not spilling, f"(rows, sums stored to the stack per input) in row_groups' inner loops: {spilling}"
