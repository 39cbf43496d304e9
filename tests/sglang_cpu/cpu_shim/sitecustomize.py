"""Loaded by every Python process of a real-SGLang test server (this folder is on PYTHONPATH):
test support for running SGLang's mooncake KV transfer without a GPU, never part of what a GPU
user runs.

SGLang's prefill records a ``torch.cuda.Event`` in ``_send_kv_chunk`` when its KV sender says it
``supports_host_tensor_indices``, which dies on a CPU-only torch. Turning the attribute off sends
KV the way a sender without that support does. The attribute is set by an import hook in each
process, right after ``sglang.srt.disaggregation.mooncake.conn`` is loaded, whichever process
loads it first.

SGLang asks for the ``spawn`` start method (a CUDA context does not survive ``fork``), so each
server's scheduler and detokenizer import SGLang and torch again, which is most of a server's
start on the CPU. With no CUDA context here they are forked instead and inherit the launcher's
imports: measured on 2 shared cores, a PD pair is ready in 33 s rather than 58 s, the tests'
fleet of six in 79 s rather than 159 s. The processes run the same code once started.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import multiprocessing
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


_set_start_method = multiprocessing.set_start_method


def _fork_for_spawn(method: str | None, force: bool = False) -> None:
    """``multiprocessing.set_start_method`` with ``fork`` wherever ``spawn`` is asked for."""
    _set_start_method("fork" if method == "spawn" else method, force=force)


multiprocessing.set_start_method = _fork_for_spawn
