"""One junit XML from the several that a resumed GPU test run wrote, a process each
(`benchmarks/gpu_run.sh`, `gpu_tests`): each process's `<testsuite>` under one `<testsuites>`,
named by its place in the run, and the totals summed on the root. Missing inputs are skipped
(a process killed before it wrote its XML).

    python benchmarks/gpu_tests_xml.py OUT.xml IN-1.xml IN-2.xml ...
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

COUNTS = ("tests", "failures", "errors", "skipped")


def merge(paths: list[Path]) -> ET.Element:
    root = ET.Element("testsuites")
    totals = dict.fromkeys(COUNTS, 0)
    for n, path in enumerate(paths, 1):
        if not path.is_file():
            continue
        tree = ET.parse(path).getroot()
        for suite in [tree] if tree.tag == "testsuite" else tree.iter("testsuite"):
            suite.set("name", f"{suite.get('name', 'pytest')} (process {n} of the run)")
            for key in COUNTS:
                totals[key] += int(suite.get(key, 0))
            root.append(suite)
    for key, value in totals.items():
        root.set(key, str(value))
    return root


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out, paths = Path(argv[0]), sorted((Path(p) for p in argv[1:]), key=lambda p: (len(p.name), p.name))
    ET.ElementTree(merge(paths)).write(out, encoding="utf-8", xml_declaration=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
