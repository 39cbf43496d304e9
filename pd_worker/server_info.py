"""``/server_info`` and ``/model_info`` bodies as SGLang 0.5.23 builds them.

``/server_info`` is the resolved launch arguments (every ``ServerArgs`` field), the scheduler's
handshake info (``status``, ``max_total_num_tokens``, ``max_req_input_len``, ``startup_time``,
``hicache_object_layout``), ``kv_events``, the tokenizer's ``startup_time``, one
``internal_states`` entry per DP rank (the resolved arguments again plus the live scheduler
state), ``version`` and ``frontend``. Every key is present with the type SGLang gives it; values
the toy model has no equivalent for keep SGLang's defaults.
"""

from __future__ import annotations

from typing import Any

from pd_worker.config import DEFAULT_BOOTSTRAP_PORT, WorkerConfig
from pd_worker.engine import Engine
from pd_worker.sglang_args import SERVER_ARGS_DEFAULTS

SGLANG_VERSION = "0.5.23"
PAGE_SIZE = 1
# SGLang's max_req_input_len: the longest request minus this margin for the output's start.
INPUT_LEN_MARGIN = 5


def server_args(config: WorkerConfig) -> dict[str, Any]:
    """``ServerArgs.resolved_dict()``: the defaults with what this worker was launched with."""
    timing = config.timing
    return {
        **SERVER_ARGS_DEFAULTS,
        "model_path": config.model_path,
        "tokenizer_path": config.model_path,
        "served_model_name": config.model_name,
        "host": config.host,
        "port": config.port,
        "api_key": config.api_key,
        "admin_api_key": config.admin_api_key,
        "disaggregation_mode": config.role,
        "disaggregation_bootstrap_port": config.bootstrap_port,
        "disaggregation_transfer_backend": "mooncake",
        "enable_pd_role_switch": config.enable_pd_role_switch,
        "max_running_requests": timing.max_running_requests,
        "max_total_tokens": timing.max_total_num_tokens,
        "chunked_prefill_size": timing.max_prefill_tokens,
        "max_prefill_tokens": timing.max_prefill_tokens,
        "page_size": PAGE_SIZE,
        "enable_dp_attention": False,
    }


def max_req_input_len(engine: Engine) -> int:
    """The longest prompt SGLang admits: the KV capacity less one token, less the margin."""
    return engine.kv_pool.capacity - 1 - INPUT_LEN_MARGIN


def server_info(config: WorkerConfig, engine: Engine) -> dict[str, Any]:
    """The ``/server_info`` body."""
    args = server_args(config)
    scheduler_startup = engine.startup_time
    return {
        **args,
        "disaggregation_bootstrap_port": _bootstrap_port(config, engine),
        "launch_command": None,
        "status": "ready",
        "max_total_num_tokens": engine.kv_pool.capacity,
        "max_req_input_len": max_req_input_len(engine),
        "hicache_object_layout": {
            "enabled": False,
            "backend": None,
            "page_size": PAGE_SIZE,
            "hicache_object_layout": {"pools": []},
            "reason": "Hierarchical cache is disabled",
        },
        "kv_events": None,
        "startup_time": dict(
            scheduler_startup, tokenizer_e2e=scheduler_startup.get("scheduler_e2e", 0.0)
        ),
        "internal_states": [{**args, **engine.internal_state()}],
        "version": SGLANG_VERSION,
        "frontend": "python",
    }


def _bootstrap_port(config: WorkerConfig, engine: Engine) -> int:
    """The port the bootstrap server listens on; a regular server runs none and reports the
    argument, as SGLang does (its default when not given)."""
    if engine.bootstrap_port is not None:
        return engine.bootstrap_port
    return config.bootstrap_port or DEFAULT_BOOTSTRAP_PORT


def model_info(config: WorkerConfig, engine: Engine) -> dict[str, Any]:
    """The ``/model_info`` body: the served model and the live role."""
    return {
        "model_path": config.model_path,
        "served_model_name": config.model_name,
        "tokenizer_path": config.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": engine.role_name,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "toy",
        "architectures": ["ToyForCausalLM"],
    }
