"""The examples and the README's Python example run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "python-bindings" / "examples"


def _run(args, timeout=300, cwd=None):
    env = {**os.environ, "OXCCL_SOCKET_IFNAME": "lo"}
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("ranks", [2, 3])
def test_numpy_sgd_matches_single_process_training(ranks):
    rc, out, err = _run([str(EXAMPLES / "numpy_sgd.py"), "--ranks", str(ranks)])
    assert rc == 0, out + err
    m = re.search(r"(\d+) ranks, \d+ steps: loss ([\d.]+); max \|w - w_single_process\| = ([\d.e+-]+)", out)
    assert m, out
    assert int(m.group(1)) == ranks and float(m.group(3)) < 1e-12 and float(m.group(2)) < 0.01
    assert "OK: matches single-process training" in err


def test_ddp_example_trains():
    pytest.importorskip("torch", reason="torch is not installed (scripts/python-tests.sh installs it)")
    rc, out, err = _run([str(EXAMPLES / "ddp_torch.py"), "--ranks", "2"], timeout=600)
    assert rc == 0, out + err
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", out)]
    assert len(losses) == 4 and losses[-1] < losses[0] / 10, out


def test_readme_python_example(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert len([l for l in code.splitlines() if l.strip()]) <= 12
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    rc, out, err = _run([str(script)], timeout=120, cwd=tmp_path)
    assert rc == 0, out + err
    # Two processes print at once: their lines may interleave, so match each rank's output.
    assert sorted(re.findall(r"rank (\d): \[1\.5 1\.5 1\.5 1\.5\]", out)) == ["0", "1"], out + err
