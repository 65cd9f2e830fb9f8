"""The options (vllm_nvfp4kv/config.py): one typed config per engine from vLLM's
additional_config["nvfp4kv"], the NVFP4KV_* environment variables as the fallback read in that
one place, refusals with the option's name, README's table generated from the fields; and
that nothing writes the environment."""
import ast
import dataclasses
from pathlib import Path
from unittest import mock

import pytest

from vllm_nvfp4kv import config as C
from vllm_nvfp4kv.config import NvFp4KVConfig
from vllm_nvfp4kv.kernels.format import DEFAULT_BLOCK_SCALES

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- options table: python -m vllm_nvfp4kv.config --markdown (do not edit here) -->"
END = "<!-- end of options table -->"


def test_readme_table_is_the_rendered_one():
    """README's options table is markdown_table() (regenerate it with
    python -m vllm_nvfp4kv.config --markdown)."""
    text = (ROOT / "README.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    table = text.split(BEGIN)[1].split(END)[0].strip("\n") + "\n"
    assert table == C.markdown_table()


def test_every_option_has_one_docstring_and_one_default():
    docs = C.field_docs()
    fields = dataclasses.fields(NvFp4KVConfig)
    assert [f.name for f in fields] == list(docs)
    assert all(f.default is not dataclasses.MISSING for f in fields)
    rows = C.markdown_table().splitlines()[4:]
    public = [f.name for f in fields if not f.metadata.get("internal")]
    assert [r.split("`")[1] for r in rows] == public and "decode_variant" not in public
    assert NvFp4KVConfig().block_scales == DEFAULT_BLOCK_SCALES


def test_additional_config_then_environment_then_default():
    env = {"NVFP4KV_ROTATE_K": "0", "NVFP4KV_CENTER_K": "1", "NVFP4KV_CALIBRATE_HEADROOM": "8",
           "NVFP4KV_FUSE_TRANSFORMS": "0"}
    cfg = NvFp4KVConfig.from_sources({"rotate_k": "1", "block_scales": "4over6",
                                      "scales_file": None}, env)
    assert (cfg.rotate_k, cfg.block_scales, cfg.center_k) == ("1", "4over6", "1")
    assert cfg.calibrate_headroom == 8.0 and cfg.fuse_transforms is False
    assert cfg.scales_file is None and cfg.workspace_prefix_tokens == 65536
    assert NvFp4KVConfig.from_sources({}, {}) == NvFp4KVConfig()
    # JSON spellings: booleans for the 1 / 0 options, numbers for numbers
    cfg = NvFp4KVConfig.from_sources({"rotate_k": False, "rotate_v": True,
                                      "workspace_prefix_tokens": 4096.0, "calibrate": "1"}, {})
    assert (cfg.rotate_k, cfg.rotate_v, cfg.workspace_prefix_tokens) == ("0", True, 4096)
    assert cfg.calibrate == "online" and cfg.changed() == {
        "rotate_k": "0", "rotate_v": True, "workspace_prefix_tokens": 4096,
        "calibrate": "online"}
    # the older name of block_scales, from the environment only
    assert NvFp4KVConfig.from_sources({}, {"NVFP4KV_FOUR_OVER_SIX": "1"}).block_scales == "4over6"


@pytest.mark.parametrize("section,env,match", [
    ({"rotate": "1"}, {}, r"unknown option\(s\) rotate; the options are block_scales"),
    ({"block_scales": "best"}, {}, r"block_scales \(additional_config\['nvfp4kv'\]"
                                   r"\['block_scales'\]\): expected one of amax6, 4over6"),
    ({}, {"NVFP4KV_ROTATE_K": "yes please"}, r"rotate_k \(NVFP4KV_ROTATE_K='yes please'\)"),
    ({}, {"NVFP4KV_FUSE_TRANSFORMS": "2"}, "true / false"),
    ({}, {"NVFP4KV_CALIBRATE_HEADROOM": "-1"}, "a positive number"),
    ({"workspace_prefix_tokens": 1.5}, {}, "a positive integer"),
    ({"workspace_dtype": "fp16"}, {}, "auto, fp8"),
    ({"scales_file": 3}, {}, "a path"),
    ({}, {"NVFP4KV_DECODE_VARIANT": "fast"}, "NVFP4KV_DECODE_VARIANT='fast'.*v_rows"),
])
def test_unknown_keys_and_bad_values_are_refused(section, env, match):
    with pytest.raises(ValueError, match=match):
        NvFp4KVConfig.from_sources(section, env)


def test_unknown_environment_variables_are_reported():
    with mock.patch.object(C.logger, "warning") as warn:
        NvFp4KVConfig.from_sources({}, {"NVFP4KV_ROTATEK": "0", "NVFP4KV_ASSETS": "/tmp"})
    assert warn.call_count == 1 and warn.call_args[0][1] == "NVFP4KV_ROTATEK"


def test_built_once_per_engine_from_additional_config():
    """for_engine: the VllmConfig's additional_config["nvfp4kv"] (which vLLM hashes into its
    config hash, so that options are part of it), the same object at every call for that
    VllmConfig, a new one for another."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig
    a = VllmConfig(additional_config={"nvfp4kv": {"block_scales": "amax6"}})
    b = VllmConfig(additional_config={"nvfp4kv": {"block_scales": "4over6"}})
    with mock.patch.dict("os.environ", {"NVFP4KV_ROTATE_V": "1"}):
        cfg = C.for_engine(a)
    assert cfg.block_scales == "amax6" and cfg.rotate_v
    with mock.patch.dict("os.environ", {"NVFP4KV_ROTATE_V": "0"}):
        assert C.for_engine(a) is cfg  # built once: the environment is not read again
        assert C.for_engine(b).block_scales == "4over6" and not C.for_engine(b).rotate_v
    assert a.compute_hash() != b.compute_hash()
    with pytest.raises(ValueError, match="JSON object"):
        C.for_engine(VllmConfig(additional_config={"nvfp4kv": "amax6"}))
    assert C.for_engine(None) == NvFp4KVConfig.from_env()


def _sources(*folders):
    return [p for f in folders for p in sorted((ROOT / f).glob("*.py"))]


def _environment_uses(tree):
    """(node, is_write, literal key or None) of each use of os.environ / os.getenv."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete, ast.AugAssign)):
            for t in getattr(node, "targets", None) or [node.target]:
                if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ":
                    key = t.slice.value if isinstance(t.slice, ast.Constant) else None
                    yield node, True, key
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, attr = ast.unparse(node.func.value), node.func.attr
            if owner == "os.environ" or (owner == "os" and attr == "getenv"):
                first = node.args[0] if node.args else None
                key = first.value if isinstance(first, ast.Constant) else None
                yield node, attr in ("pop", "setdefault", "update", "__setitem__"), key
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
            yield node, False, key


def test_nothing_writes_the_environment_and_one_module_reads_it():
    """No NVFP4KV_* variable is written by the package, the kernels or evals (options travel
    in the config: additional_config["nvfp4kv"]), and config.py is the package's only reader
    of the environment."""
    writes, reads = [], []
    for path in _sources("vllm_nvfp4kv", "kernels", "evals"):
        for node, write, key in _environment_uses(ast.parse(path.read_text())):
            where = f"{path.parent.name}/{path.name}:{node.lineno}"
            if write and (key is None or str(key).startswith("NVFP4KV_")):
                writes.append(where)
            elif not write and path.parent.name == "vllm_nvfp4kv" and path.name != "config.py":
                reads.append(where)
    assert writes == [] and reads == []
