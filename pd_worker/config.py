"""Launch configuration of one worker process (what SGLang calls server args)."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field

from pd_protocol.wire import ROLES
from pd_worker.timing import TimingModel

# Not SGLang's 30000: that is pd-router's default port too, and the router goes in front.
DEFAULT_PORT = 30001
# SGLang's default bootstrap port, taken by a prefill launched without one (when free).
DEFAULT_BOOTSTRAP_PORT = 8998
DEFAULT_DECODE_CUDA_GRAPH_BS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 256)
# The data planes ``--engine`` chooses from (pd_worker.data_plane, pd_worker.torch_plane).
ENGINES = ("timing", "torch")
# SGLang's ``--disaggregation-mode null``: a regular server that prefills and decodes alone.
REGULAR_MODE = "null"
# What ``--disaggregation-mode`` takes: the PD roles, or a regular server.
MODES = (*ROLES, REGULAR_MODE)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker is launched with; reported at the top level of ``/server_info``."""

    role: str = "prefill"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # None: chosen when the worker starts (Engine._bind_bootstrap).
    bootstrap_port: int | None = None
    enable_pd_role_switch: bool = False
    model_path: str = "pd-worker/toy-model"
    served_model_name: str | None = None
    admin_api_key: str | None = None
    api_key: str | None = None
    enable_faults: bool = False
    decode_cuda_graph_memory_gb: float = 0.6
    gpu_free_memory_gb: float = 8.0
    # SGLang's --ssl-certfile/--ssl-keyfile (serve HTTPS) and --ssl-ca-certs (with them:
    # require client certificates signed by this CA, i.e. mTLS).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    timing: TimingModel = field(default_factory=TimingModel)
    # The data plane (one of ENGINES); the torch engine's transport and model.
    engine: str = "timing"
    kv_transfer: str = "mooncake"
    model_config: str | None = None

    def validate(self) -> None:
        """Raise ValueError with a one-line reason for an unusable configuration."""
        if self.role not in MODES:
            raise ValueError(f"role must be one of {', '.join(MODES)}, got {self.role!r}")
        for name in ("port", "bootstrap_port"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 65536:
                raise ValueError(f"{name} must be in 1..65535, got {value}")
        if self.port == self.bootstrap_port:
            raise ValueError("port and bootstrap_port must differ")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile must be given together")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs needs ssl_certfile and ssl_keyfile")
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file: {path}")
        try:
            self.ssl_context()
        except OSError as exc:
            raise ValueError(f"cannot load the TLS files: {exc}") from exc
        if self.decode_cuda_graph_memory_gb < 0 or self.gpu_free_memory_gb < 0:
            raise ValueError("memory sizes must be >= 0")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        self.timing.validate()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self.ssl_certfile is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """The HTTP listener's context (None: plain HTTP); with ``ssl_ca_certs`` a client
        must present a certificate signed by that CA. Raises OSError or ssl.SSLError for
        files that cannot be loaded."""
        if self.ssl_certfile is None or self.ssl_keyfile is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ssl_ca_certs)
        context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        if self.ssl_ca_certs is not None:
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    @property
    def regular(self) -> bool:
        """A regular (non-disaggregated) server: no bootstrap server, no role switch."""
        return self.role == REGULAR_MODE

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path
