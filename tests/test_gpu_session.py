"""evals/gpu_session.sh, the script every GPU call runs: device time is scarce, so what can be
checked without a GPU is checked here. It parses; every stage its usage line names has a
branch; result files are named by the GPU they ran on, with the variable braced (a bare
`$GPU_32k` would expand the unset GPU_32k and drop the name)."""
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "evals" / "gpu_session.sh"
TEXT = SCRIPT.read_text()


def test_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_listed_stage_has_a_branch():
    usage = re.search(r"gpu_session\.sh ([a-z0-9|-]+)", TEXT).group(1).split("|")
    branches = set()
    for pattern in re.findall(r"^  ([a-z0-9|-]+)\)", TEXT, flags=re.M):
        branches.update(pattern.split("|"))
    assert set(usage) == branches


def test_results_are_named_by_the_gpu():
    outs = re.findall(r'"\$OUT/([^"]+)"', TEXT)
    assert outs
    for name in outs:
        assert "h200" not in name and "h100" not in name, name
        assert "$GPU" not in name, f"unbraced $GPU in {name}"
    assert sum("${GPU}" in n for n in outs) >= len(outs) - 3  # a few scratch names (ncu)
