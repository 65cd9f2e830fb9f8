"""Accuracy and performance evaluations of the NVFP4 KV cache: one script per measurement,
each run as a module from the checkout root (`python -P -m evals.NAME --help`), writing JSON
that README.md and evals/RESULTS.md quote. What they share is in evals/common.py (results,
provenance, per-dtype processes, plots), evals/assets.py (the real models that come as
packages) and evals/server.py (a `vllm serve` process and its HTTP clients). `-P` keeps the
checkout root off sys.path, where its kernels/ folder would shadow Hugging Face's `kernels`
package that transformers imports; the package itself is installed with this project
(`pip install -e .`), so it imports from anywhere."""
