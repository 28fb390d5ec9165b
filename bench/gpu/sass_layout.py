#!/usr/bin/env python3
"""Where a kernel's machine code lies, from a cubin built here (no GPU needed).

  python3 bench/gpu/sass_layout.py sizes CUBIN
      every kernel's code size in bytes (its .text section), largest last
  python3 bench/gpu/sass_layout.py layout CUBIN KERNEL SOURCE [MIN_BYTES]
      the kernel's code as runs of addresses, each named by the kernel-level source line it comes from
      (the outermost `inlined at` of nvdisasm's line info in SOURCE) and the functions inlined there;
      runs under MIN_BYTES (default 1024) are left out. Also each CALL and the functions' stack stores.

Build the cubin with line info, e.g. for the top-k:
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I. -lineinfo \\
       -cubin -o /tmp/topk.cubin kernels/cuda/topk.cu
KERNEL: a substring of the kernel's mangled name (finish_sampled, grid_topk_kernelILi8ELi2). nvdisasm comes
from $NVDISASM, the PATH, or the PyPI wheel nvidia-cuda-nvdisasm (pip download --no-deps; unzip): CUDA 13's
Debian image here has no cuobjdump or nvdisasm. Used in sessions 53-54 to find the rare paths laid out
between the top-k kernels' once-a-call steps (docs/kernels-notes.md)."""
import os
import re
import shutil
import subprocess
import sys


def nvdisasm():
    for cand in [os.environ.get("NVDISASM"), shutil.which("nvdisasm"), "/tmp/nvd/nvidia/cu13/bin/nvdisasm"]:
        if cand and os.path.exists(cand):
            return cand
    sys.exit("sass_layout: no nvdisasm (set NVDISASM; see the docstring)")


def sizes(cubin):
    out = subprocess.run(["readelf", "-SW", cubin], capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.search(r"\]\s+(\.text\.\S+)\s+\S+\s+\S+\s+\S+\s+([0-9a-f]+)", line)
        if m:
            rows.append((int(m.group(2), 16), m.group(1)[len(".text."):]))
    for size, name in sorted(rows):
        print(f"{size:8d} {name}")


def functions(source):
    """(first line, name) of each function defined at column 0 of SOURCE."""
    found = []
    for i, line in enumerate(open(source).read().split("\n"), 1):
        line = re.sub(r"__launch_bounds__\([^)]*\)", "", line)
        m = re.match(r"(?:template.*)?(?:__device__|__global__|static|inline)[^(]*?(\w+)\s*\(", line)
        if m and not line.startswith(" "):
            found.append((i, m.group(1)))
    return found


def layout(cubin, kernel, source, min_bytes):
    funcs = functions(source)

    def fn_of(n):
        name = "?"
        for first, f in funcs:
            if first > n:
                break
            name = f
        return name

    sass = subprocess.run([nvdisasm(), "-c", "-gi", cubin], capture_output=True, text=True).stdout
    inside, block, runs, calls, stores = False, [], [], [], 0
    kernel_file = None  # the file of the kernel's first line info: SOURCE as it was compiled
    cur = [("?", 0)]
    for line in sass.splitlines():
        if line.startswith(".text."):
            inside = kernel in line
            continue
        if not inside:
            continue
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if m:
            block.append((m.group(1), int(m.group(2))))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        if block:
            cur, block = block, []
            if kernel_file is None:
                kernel_file = cur[-1][0]
        outer_file, outer_line = cur[-1]
        key = (f"{fn_of(outer_line)}:{outer_line}" if outer_file == kernel_file
               else f"{os.path.basename(outer_file)}:{outer_line}")
        inner = {os.path.basename(f) + (":" + fn_of(n) if f == kernel_file else "") for f, n in cur[:-1]}
        if runs and runs[-1][2] == key:
            runs[-1][1] = addr + 16
            runs[-1][3] |= inner
        else:
            runs.append([addr, addr + 16, key, set(inner)])
        if "CALL" in m.group(2):
            calls.append((addr, re.sub(r".*\$", "", m.group(2)).rstrip(" );")))
        stores += "STL" in m.group(2)
    if not runs:
        sys.exit(f"sass_layout: no kernel matching {kernel!r} in {cubin}")
    print(f"{kernel}: {runs[-1][1]} bytes, {stores} stack stores")
    for a, b, key, inner in runs:
        if b - a >= min_bytes:
            print(f"{a:6x}-{b:6x} {b - a:6d} {key:34s} {','.join(sorted(inner))[:100]}")
    names = [c for _, c in calls]
    if names and shutil.which("c++filt"):  # every callee demangled by one c++filt
        names = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    for (a, _), what in zip(calls, names):
        what = what.strip().replace("(anonymous namespace)::", "")
        print(f"call at {a:6x}: {re.sub(r'[(].*', '', what).split('::')[-1]}")


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "sizes":
        sizes(sys.argv[2])
    elif len(sys.argv) >= 5 and sys.argv[1] == "layout":
        layout(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 1024)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
