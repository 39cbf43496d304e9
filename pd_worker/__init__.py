"""Reference PD worker: SGLang 0.5.23's prefill/decode HTTP protocol without a GPU.

``pd-worker serve --role prefill|decode ...`` runs one worker (see :mod:`pd_worker.cli`);
:mod:`pd_worker.cluster` starts several on free loopback ports for tests, demos and benchmarks.

What tests can rely on:

- The decode's output is a pure function of the prompt token ids carried in the KV payload it
  pulled from the prefill's bootstrap server: :func:`expected_text` / :func:`expected_output_ids`
  recompute it, and ``meta_info["kv_source"]`` names the prefill URL the KV came from.
- Prompts are tokenized one token per UTF-8 byte (:func:`tokenize`); chat messages go through
  :func:`chat_prompt` first.
- A request without ``bootstrap_room`` (or with SGLang's fake host ``2.2.2.2``) needs no transfer:
  a prefill just runs its forward, a decode generates from its own copy of the prompt.
- ``/server_info`` ``internal_states[0]["pd_worker"]`` holds ``id()`` of the engine, KV pool,
  bootstrap server and role object: the first three survive role switches, the last does not.
- Bootstrap fields are read per prompt, as SGLang reads them (``n > 1`` included); each sample
  of a prompt transfers under its own key derived from the prompt's room
  (:func:`pd_worker.protocol.sample_room`).
- ``/server_info`` and ``/model_info`` carry every key SGLang 0.5.23 returns
  (:mod:`pd_worker.server_info`); bodies that do not fit SGLang's request types get FastAPI's
  validation errors (:mod:`pd_worker.validation`); logprob fields follow
  :mod:`pd_worker.logprobs`.
- :mod:`pd_worker.faults` documents ``POST /fault``; :mod:`pd_worker.timing` the timing knobs.
"""

from pd_worker.tokens import chat_prompt, expected_output_ids, expected_text, tokenize

__all__ = ["chat_prompt", "expected_output_ids", "expected_text", "tokenize"]
