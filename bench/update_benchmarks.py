#!/usr/bin/env python3
"""Replaces (or appends) one '## <title>' section of docs/benchmarks.md."""
import os
import re
import sys

title, body = sys.argv[1], sys.argv[2].rstrip() + "\n"
path = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks.md")
text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\nEach section is written by the script it names.\n"
pattern = re.compile(r"^## " + re.escape(title) + r"\n.*?(?=^## |\Z)", re.S | re.M)
if pattern.search(text):
    text = pattern.sub(lambda _: body + "\n", text)
else:
    text = text.rstrip() + "\n\n" + body
open(path, "w").write(text)
