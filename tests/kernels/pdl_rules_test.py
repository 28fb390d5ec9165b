#!/usr/bin/env python3
"""The launch rules of kernels/cuda (see launch_kernel in kernels/cuda/common.cuh),
checked on the source, so that a kernel added or edited without them fails in CI
(where no GPU runs the kernels):
  - every kernel is launched through launch_kernel / launch_kernel_ex (no <<< >>>):
    the programmatic-dependent-launch attribute comes with it;
  - every kernel's first statement is pdl_entry(), or the kernel hands that to
    gemv_core<..., true> (which waits after requesting weights);
  - no __ldg: an earlier kernel's output read through the non-coherent path may be
    stale under PDL (the race that broke the GPU decoder test on 2026-12-01).
Usage: pdl_rules_test.py [KERNELS_CUDA_DIR]"""
import pathlib
import re
import sys


def past_match(text, i, opening, closing):
    """The index after the bracket that closes the one at text[i]."""
    depth = 0
    while True:
        depth += text[i] == opening
        depth -= text[i] == closing
        i += 1
        if depth == 0:
            return i


def kernels(text):
    """(name, body) of every __global__ function definition."""
    for m in re.finditer(r"__global__\s", text):
        i = text.index("(", m.end())
        # skip __launch_bounds__(...) to the parameter list
        head = text[m.end():i]
        if "__launch_bounds__" in head:
            i = text.index("(", text.index(")", i) + 1)
        name = re.findall(r"(\w+)\s*$", text[m.end():i])[0]
        k = past_match(text, i, "(", ")")
        while text[k] not in "{;":
            k += 1
        if text[k] == ";":
            continue  # a declaration
        yield name, text[k + 1:past_match(text, k, "{", "}") - 1]


def first_statement(body):
    lines = [l.strip() for l in body.splitlines()]
    for l in lines:
        if not l or l.startswith("//"):
            continue
        return l
    return ""


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parents[2] / "kernels/cuda")
    problems, count = [], 0
    for path in sorted(root.glob("*.cu")) + sorted(root.glob("*.cuh")):
        text = path.read_text()
        code = re.sub(r"//[^\n]*", "", text)
        if "<<<" in code:
            problems.append(f"{path.name}: a <<< >>> launch (use launch_kernel)")
        if "__ldg" in code:
            problems.append(f"{path.name}: __ldg (plain loads for what earlier kernels wrote)")
        for name, body in kernels(text):
            count += 1
            first = first_statement(body)
            if first.startswith("pdl_entry();"):
                continue
            if re.search(r"gemv_core<[^>]*,\s*true>", body):
                continue
            problems.append(f"{path.name}: kernel {name} does not open with pdl_entry() (first: {first[:60]!r})")
    if count == 0:
        problems.append(f"no kernels found under {root}")
    for p in problems:
        print(p)
    print(f"{count} kernels checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
