"""The README's Python example runs as written (on smaller sizes)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    code = blocks[0].replace("4096", "128").replace("1000", "50")
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102 - our own README
    assert ns["out"].shape == (2, 8, 128, 64)
    assert ns["y"].shape == (2, 50, 512)
    assert torch.isfinite(ns["y"]).all()
    assert ns["tokens"].shape[0] == 1 and ns["tokens"].shape[1] >= 20
    assert ns["logits"].shape == (2, 10)


def test_readme_starts_with_install_and_test_commands():
    lines = README.read_text().splitlines()
    cmds = [ln for ln in lines[:8] if ln and not ln.startswith(("#", "```"))]
    assert cmds[0].startswith("pip install") and "pytest" in cmds[1]
    ci = (README.parent / ".ci" / "run").read_text()
    assert cmds[0] in ci and cmds[1] in ci, "CI must run the README's own commands"
