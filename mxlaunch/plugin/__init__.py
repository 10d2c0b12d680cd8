"""The in-engine plugin: code that runs inside engine processes (API server, engine core, workers).

    loader.py   engine-neutral core (torch): capture a model's raw tensors, restore them from files
    vllm.py     vLLM adapter: the `vllm.general_plugins` entry point, load format "mxlaunch"

Importing this package (or `mxlaunch.plugin.vllm`) imports neither torch nor the engine: the entry point
runs in every engine process and must stay cheap. docs/plugin.md explains the whole path.
"""
