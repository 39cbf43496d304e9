"""Reference PD worker: SGLang 0.5.23's prefill/decode HTTP protocol without a GPU.

Public helpers for tests and benchmarks:

- :func:`expected_text` / :func:`expected_output_ids`: what a decode returns for a prompt whose KV
  it pulled from the prefill that served the same prompt (checks P/D pairing).
- :func:`tokenize`, :func:`chat_prompt`: the worker's toy tokenizer and chat template.
- :mod:`pd_worker.cluster`: start and stop worker processes on free loopback ports.
"""

from pd_worker.tokens import chat_prompt, expected_output_ids, expected_text, tokenize

__all__ = ["chat_prompt", "expected_output_ids", "expected_text", "tokenize"]
