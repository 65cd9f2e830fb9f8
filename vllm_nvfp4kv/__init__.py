"""vLLM plugin: NVFP4 KV cache on Hopper and Ampere/Ada. Importing this package imports no vLLM;
``vllm_nvfp4kv.plugin.register`` is the ``vllm.general_plugins`` entry point."""
__version__ = "0.1.0"
