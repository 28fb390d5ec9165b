#!/usr/bin/env python3
"""The launch rules of kernels/cuda (see launch_kernel in kernels/cuda/common.cuh),
checked on the source, so that a kernel added or edited without them fails in CI
(where no GPU runs the kernels):
  - every kernel is launched through launch_kernel / launch_kernel_ex (no <<< >>>):
    the programmatic-dependent-launch attribute comes with it;
  - every kernel's first statement is pdl_entry(), or the kernel hands that to
    gemv_core<..., true> (which waits after requesting weights), or it names in a
    `// pdl-prologue: p, q` comment the only pointer parameters the code before its
    pdl_entry() may use (weights: no kernel writes them);
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
    """(name, parameters, body) of every __global__ function definition."""
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
        yield name, text[i + 1:past_match(text, i, "(", ")") - 1], text[k + 1:past_match(text, k, "{", "}") - 1]


def prologue_problem(params, body):
    """None when the code before the body's first pdl_entry() uses only the pointer parameters its
    `// pdl-prologue:` comment names; else what is wrong."""
    m = re.search(r"//\s*pdl-prologue:\s*([\w, ]+)", body)
    if m is None or "pdl_entry();" not in body:
        return "no pdl-prologue comment and pdl_entry() call"
    allowed = {a.strip() for a in m.group(1).split(",")}
    pointers = re.findall(r"\*\s*(?:__restrict__\s*)?(\w+)\s*(?:,|$)", params.replace("\n", " "))
    prologue = re.sub(r"//[^\n]*", "", body[:body.index("pdl_entry();")])
    used = [p for p in pointers if p not in allowed and re.search(rf"(?<![\w.]){p}\b", prologue)]
    return f"uses {', '.join(used)} before pdl_entry()" if used else None


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
        for name, params, body in kernels(text):
            count += 1
            first = first_statement(body)
            if first.startswith("pdl_entry();"):
                continue
            if re.search(r"gemv_core<[^>]*,\s*true>", body):
                continue
            if "pdl-prologue:" in body:
                why = prologue_problem(params, body)
                if why is not None:
                    problems.append(f"{path.name}: kernel {name}: {why}")
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
