"""The only subpackage that imports vLLM.

`plugin.register` is the `vllm.general_plugins` entry point; `hooks` lists,
in order, every place where the plugin touches vLLM and why.
"""
