"""Helpers of the pool tests (tests/actors/serve_flags_test.py, tests/integration/run_node_test.py):
what `troupe plan` gives for a budget, and the memory a fraction is a fraction of."""
import subprocess
from pathlib import Path


def mem_available():
    """/proc/meminfo's MemAvailable, bytes (what the CPU backend's memory_info reports free)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def plan_pages(troupe, model, budget, *args):
    """Pages per pool that `troupe plan` gives for `budget` bytes (pools it gives none left out)."""
    out = subprocess.run([str(troupe), "plan", "--model", str(model), "--memory", str(int(budget)), "--markdown",
                          *args], check=True, capture_output=True, text=True).stdout
    pages = {}
    for row in out.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if int(cells[2]) > 0:
            pages[cells[0]] = int(cells[2])
    return pages
