"""One junit XML from the several that a resumed GPU test run wrote, a process each
(`benchmarks/gpu_run.sh`, `gpu_tests`): each process's `<testsuite>` under one `<testsuites>`,
named by its place in the run, and the totals summed on the root. Missing inputs are skipped
(a process killed before it wrote its XML).

With `--faulty-rows XML`: the bench's competitor patterns of the 16-bit modes whose float64
test failed in that run (tests/test_gpu.py::test_sixteen_bit_products_match_float64_at_4096,
`[<backend>-<mode>]`; bf16x3's with `fastrpe-auto*`, which runs it by default since 2026-11-28;
tf32x3's none), comma-separated: gpu_run.sh leaves those rows out of the session's bench
(`--skip`), since a kernel that failed its float64 check on this machine times nothing worth
having, and one that faulted would break the bench's CUDA context (a restart each: the fourth
H100 session lost three to the bf16x3 rows).

    python benchmarks/gpu_tests_xml.py OUT.xml IN-1.xml IN-2.xml ...
    python benchmarks/gpu_tests_xml.py --faulty-rows XML
"""
from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

COUNTS = ("tests", "failures", "errors", "skipped")
#: the 16-bit modes' float64 test: its parameters name the backend and the mode
SIXTEEN_BIT = re.compile(r"test_sixteen_bit_products_match_float64_at_4096\[(\w+)-([\w-]+)\]")


def merge(paths: list[Path]) -> ET.Element:
    root = ET.Element("testsuites")
    totals = dict.fromkeys(COUNTS, 0)
    for n, path in enumerate(paths, 1):
        if not path.is_file():
            continue
        tree = ET.parse(path).getroot()
        for suite in [tree] if tree.tag == "testsuite" else tree.iter("testsuite"):
            num = path.stem if path.stem.isdigit() else n  # (gpu_tests names them by process)
            suite.set("name", f"{suite.get('name', 'pytest')} (process {num} of the run)")
            for key in COUNTS:
                totals[key] += int(suite.get(key, 0))
            root.append(suite)
    for key, value in totals.items():
        root.set(key, str(value))
    return root


def faulty_rows(path: Path) -> list[str]:
    """`fastrpe-<backend>+<mode>*` for each 16-bit mode test that failed or errored in the junit
    XML at `path` (none if it is missing)."""
    if not path.is_file():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        m = SIXTEEN_BIT.search(case.get("name", ""))
        # (tf32x3, the plain rows' mode, which every session has run: no pattern names those rows
        # alone. bf16x3 is also the library's default for 16-bit calls, so `auto` runs it)
        if m and m.group(2) != "tf32x3" and (case.find("failure") is not None or case.find("error") is not None):
            out.append(f"fastrpe-{m.group(1)}+{m.group(2)}*")
            if m.group(2) == "bf16x3":
                out.append("fastrpe-auto*")
    return sorted(set(out))


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--faulty-rows":
        print(",".join(faulty_rows(Path(argv[1]))))
        return 0
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out, paths = Path(argv[0]), sorted((Path(p) for p in argv[1:]), key=lambda p: (len(p.name), p.name))
    ET.ElementTree(merge(paths)).write(out, encoding="utf-8", xml_declaration=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
