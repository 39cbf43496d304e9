"""Launch configuration of one worker process (what SGLang calls server args)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_protocol.wire import ROLES
from pd_worker.timing import TimingModel

DEFAULT_DECODE_CUDA_GRAPH_BS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 256)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker is launched with; reported at the top level of ``/server_info``."""

    role: str = "prefill"
    host: str = "127.0.0.1"
    port: int = 30000
    bootstrap_port: int = 8998
    enable_pd_role_switch: bool = False
    model_path: str = "pd-worker/toy-model"
    served_model_name: str | None = None
    admin_api_key: str | None = None
    api_key: str | None = None
    enable_faults: bool = False
    decode_cuda_graph_memory_gb: float = 0.6
    gpu_free_memory_gb: float = 8.0
    timing: TimingModel = field(default_factory=TimingModel)

    def validate(self) -> None:
        """Raise ValueError with a one-line reason for an unusable configuration."""
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        for name in ("port", "bootstrap_port"):
            value = getattr(self, name)
            if not 0 < value < 65536:
                raise ValueError(f"{name} must be in 1..65535, got {value}")
        if self.port == self.bootstrap_port:
            raise ValueError("port and bootstrap_port must differ")
        if self.decode_cuda_graph_memory_gb < 0 or self.gpu_free_memory_gb < 0:
            raise ValueError("memory sizes must be >= 0")
        self.timing.validate()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path
