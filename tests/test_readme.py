"""The README's CPU commands work verbatim: every fenced block after a
`<!-- readme-cpu-command: NAME -->` marker runs under bash from the checkout root, in the
environment it names (`.venv-0.32`, which `make` creates), and must exit 0."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- readme-cpu-command: (\S+) -->\s*```bash\n(.*?)```", re.S)


def readme_cpu_commands() -> dict[str, str]:
    return dict(BLOCK.findall((ROOT / "README.md").read_text()))


def test_the_readme_marks_its_cpu_commands():
    assert "serve" in readme_cpu_commands()


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(readme_cpu_commands()))
def test_readme_cpu_command(name):
    script = readme_cpu_commands()[name]
    venv = re.search(r"(\.venv-[0-9.]+)/bin/python", script)
    if venv and Path(sys.prefix).resolve() != (ROOT / venv.group(1)).resolve():
        pytest.skip(f"the README runs it in {venv.group(1)}; this is {sys.prefix}")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    if name == "serve":
        assert '"text"' in run.stdout  # the completion came back
