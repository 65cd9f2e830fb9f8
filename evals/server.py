"""Start and stop `vllm serve` (the OpenAI server module) on loopback for the evals scripts.

The module is run as `python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs:
the `vllm` CLI itself needs the dist named "vllm", which vLLM's CPU build is not.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from evals import common


def sse_events(response):
    """The JSON events of a streamed OpenAI API response, up to [DONE]."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def post_completion(port: int, body: dict, timeout: float):
    """POST /v1/completions on loopback: (connection, response), or (None, an error result)
    when the server answers with another status than 200. The caller closes the connection."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        err = {"status": "error", "error": f"HTTP {r.status}: {r.read()[:300]!r}"}
        conn.close()
        return None, err
    return conn, r


def completion_result(port: int, body: dict, timeout: float, read) -> dict:
    """POST /v1/completions and return read(response, t0): every failure (another status
    than 200, a broken stream, a timeout) becomes an error result; the connection is closed."""
    t0 = time.time()
    conn = None
    try:
        conn, r = post_completion(port, body, timeout)
        return r if conn is None else read(r, t0)
    except Exception as e:  # noqa: BLE001 - every failure is a result here
        return {"status": "error", "error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        if conn is not None:
            conn.close()


def prometheus(port: int) -> list[tuple[str, str, float]]:
    """The server's vllm: samples from /metrics as (name, '{labels}' or '', value)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse_prometheus(r.read().decode())


def parse_prometheus(text: str) -> list[tuple[str, str, float]]:
    out = []
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_:]+)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)$", line)
        if m:
            out.append((m.group(1), m.group(2) or "", float(m.group(3))))
    return out


def metrics(port: int) -> tuple[dict[str, float], dict[str, str]]:
    """The server's vllm: counters and gauges summed over labels (a counter's _total suffix
    dropped), and the labels of vllm:cache_config_info."""
    out, cache_info = {}, {}
    for name, labels, val in prometheus(port):
        if name.endswith("_created"):
            continue
        name = name.removesuffix("_total")
        if name == "vllm:cache_config_info":
            cache_info = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            continue
        out[name] = out.get(name, 0.0) + val
    return out, cache_info


def serve_cmd(model: str, kv_cache_dtype: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--kv-cache-dtype", kv_cache_dtype, "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", "m", *extra]


def cpu_env() -> dict:
    """Environment for vLLM's CPU engine (no inductor warm-up, 1 GiB of KV)."""
    return {**os.environ, "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


class Server:
    """`with Server(cmd, log_path, env) as s:` starts the server, waits for /health (raising
    if it exits or misses the deadline), and stops it on exit. s.startup_s: seconds to
    healthy."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict | None = None,
                 deadline_s: float = 600):
        self.cmd, self.log_path, self.env, self.deadline_s = cmd, Path(log_path), env, deadline_s
        self.port = int(cmd[cmd.index("--port") + 1])
        self.startup_s = None

    def __enter__(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        # PYTHONSAFEPATH: `python -m` from the repository root would put its kernels/ first on
        # sys.path, shadowing Hugging Face's `kernels` package that transformers imports
        env = {**(os.environ if self.env is None else self.env), "PYTHONSAFEPATH": "1"}
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see "
                                   f"{self.log_path}:\n" + self.log_tail())
            if time.time() - t0 > self.deadline_s:
                self.__exit__()
                raise RuntimeError("server did not become healthy before the deadline")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        self.startup_s = round(time.time() - t0, 1)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def startup_lines(self) -> list[str]:
        """The log lines that show the chosen backend and the KV capacity."""
        return [x for x in self.log_path.read_text(errors="replace").splitlines()
                if "CUSTOM" in x or "NVFP4 KV cache" in x or "KV cache size" in x
                or "Maximum concurrency" in x]

    def serving_errors(self) -> list[str]:
        """ERROR lines and tracebacks before shutdown (SIGTERM at the end makes the client
        log an EngineDeadError)."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        lines = lines[:next((i for i, x in enumerate(lines) if "[shutdown]" in x), len(lines))]
        return [x for x in lines if "ERROR" in x or "Traceback" in x][:10]


def report(res: dict, out: Path, plot, print_table) -> None:
    """Plot a benchmark's results next to its JSON and print its table."""
    png = out.with_suffix(".png")
    plot(res, png)
    print_table(res)
    print(f"\n-> {out}, {png}")


def offline_report(out: Path, combine_files: list[str] | None, combine, plot,
                   print_table) -> None:
    """--combine / --plot-only, no server: join several results files into `out` (a later
    file's measurements replace an earlier's), or load `out`; then report."""
    if combine_files:
        res = combine([common.read_json(f) for f in combine_files], combine_files)
        common.write_json(out, res)
    else:
        res = common.read_json(out)
    report(res, out, plot, print_table)
