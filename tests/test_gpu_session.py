"""evals/gpu_session.sh and its stage table evals/gpu_stages.py, what every GPU call runs:
device time is scarce, so what can be checked without a GPU is checked here. The script and
every stage's command parse; a stage that runs others names stages that exist; every eval a
stage runs is a module of evals with the options it is given; result files are named by the
GPU they ran on, with the variable braced (a bare `$GPU_32k` would expand the unset GPU_32k
and drop the name)."""
import re
import subprocess
from pathlib import Path

from evals import gpu_stages

EVALS = Path(__file__).resolve().parents[1] / "evals"
SCRIPT = EVALS / "gpu_session.sh"
STAGES = gpu_stages.STAGES
TEXT = "\n".join(st.command for st in STAGES.values())


def test_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    for name, st in STAGES.items():
        assert subprocess.run(["bash", "-n", "-c", st.command]).returncode == 0, name
        assert st.about, name


def test_stages_run_by_stages_exist():
    for name, st in STAGES.items():
        called = re.findall(r'bash "\$0" (\w[\w-]*)', st.command)
        for loop in re.findall(r"for stage in ([\w -]+); do", st.command):
            called += loop.split()
        assert all(c in STAGES for c in called if c != "$stage"), (name, called)


def test_every_eval_run_exists_with_its_options():
    runs = re.findall(r"python3 -P -m evals\.(\w+)((?:[^|;\n]|\\\n)*)", TEXT)
    assert runs
    for module, args in runs:
        source = (EVALS / f"{module}.py").read_text()
        for flag in re.findall(r"(?<![\w$])(--[a-z][a-z0-9-]*)", args):
            assert f'"{flag}"' in source, f"evals.{module} has no {flag}"
    assert "python3 evals/" not in TEXT  # scripts run as modules (-P: no checkout root)


def test_results_are_named_by_the_gpu():
    outs = re.findall(r'"\$OUT/([^"]+)"', TEXT)
    assert outs
    for name in outs:
        assert "h200" not in name and "h100" not in name, name
        assert "$GPU" not in name, f"unbraced $GPU in {name}"
    assert sum("${GPU}" in n for n in outs) >= len(outs) - 3  # a few scratch names (ncu)
