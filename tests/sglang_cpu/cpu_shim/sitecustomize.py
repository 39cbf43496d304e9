"""Loaded by every Python process of a real-SGLang test server (this folder is on PYTHONPATH):
test support for running SGLang's mooncake KV transfer without a GPU, never part of what a GPU
user runs.

SGLang's prefill records a ``torch.cuda.Event`` in ``_send_kv_chunk`` when its KV sender says it
``supports_host_tensor_indices``, which dies on a CPU-only torch. Turning the attribute off sends
KV the way a sender without that support does. SGLang starts its schedulers as spawned
processes, so the attribute is set by an import hook in each process, right after
``sglang.srt.disaggregation.mooncake.conn`` is loaded, rather than once in the launcher.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "sglang.srt.disaggregation.mooncake.conn"


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds TARGET with the normal finders and wraps its loader to patch the module."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def patched(module, _exec=exec_module):
                    _exec(module)
                    module.MooncakeKVSender.supports_host_tensor_indices = False

                spec.loader.exec_module = patched
                return spec
        return None


sys.meta_path.insert(0, _PatchAfterLoad())
