"""A small Llama-architecture model in plain torch over one preallocated KV pool.

The torch engine of the reference worker: :mod:`.config` (the model's shape), :mod:`.tokenizer`
(a byte-level BPE built locally), :mod:`.kv_pool` (the slot pool the KV transfer reads and writes
as bytes) and :mod:`.model` (prefill, batched decode and the colocated reference). Importing it
needs the ``torch`` extra.
"""
