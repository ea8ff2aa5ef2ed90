"""Medians of the benchmark tables of two commits, side by side (compare_commits.sh).

Reads DIR/<bench>_<old|new>_<round>.txt, the stdout of vlm-bench-language and
vlm-bench-serving, finds their markdown tables and prints, for every numeric
cell, the median over the rounds of old and of new and new / old. A row of a
table is named by its text columns (metric, config) and its count columns
(streams, turn), e.g. "config engine, streams 2"; every other column is a figure. A cell's figure is its first
number ("12.3 ms" -> 12.3, "1.02x (0.98 1.05)" -> 1.02); cells without one
("-") are skipped.

Usage: compare_tables.py DIR
"""

import collections
import pathlib
import re
import statistics
import sys

KEY_COLUMNS = {"metric", "config", "streams", "turn"}
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
FILE = re.compile(r"^(?P<bench>\w+)_(?P<side>old|new)_(?P<round>\d+)\.txt$")


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def figures(text):
    """(table index, row key, column) -> number, for one benchmark output."""
    out = {}
    lines = text.splitlines()
    table = -1
    i = 0
    while i + 1 < len(lines):
        if lines[i].startswith("|") and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1]):
            table += 1
            header = cells(lines[i])
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                row = cells(lines[i])
                key = ", ".join(c if h == "metric" else f"{h} {c}"
                                for h, c in zip(header, row) if h in KEY_COLUMNS)
                for h, c in zip(header, row):
                    if h in KEY_COLUMNS:
                        continue
                    m = NUMBER.search(c)
                    if m:
                        out[(table, key, h)] = float(m.group())
                i += 1
        else:
            i += 1
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    runs = collections.defaultdict(lambda: collections.defaultdict(list))  # bench -> side -> [figures]
    for path in sorted(pathlib.Path(sys.argv[1]).iterdir()):
        m = FILE.match(path.name)
        if m:
            runs[m["bench"]][m["side"]].append(figures(path.read_text(errors="replace")))
    if not runs:
        sys.exit("no benchmark outputs in " + sys.argv[1])
    print("| bench | row | figure | old | new | new / old |")
    print("|---|---|---|---|---|---|")
    for bench in sorted(runs):
        old, new = runs[bench]["old"], runs[bench]["new"]
        keys = []
        for f in old + new:
            keys += [k for k in f if k not in keys]
        for key in keys:
            a = [f[key] for f in old if key in f]
            b = [f[key] for f in new if key in f]
            if not a or not b:
                continue
            ma, mb = statistics.median(a), statistics.median(b)
            ratio = f"{mb / ma:.3f}" if ma != 0 else "-"
            _, row, column = key
            print(f"| {bench} | {row} | {column} | {ma:.4g} | {mb:.4g} | {ratio} |")
        print(f"| {bench} | (rounds) | | {len(old)} | {len(new)} | |")


if __name__ == "__main__":
    main()
