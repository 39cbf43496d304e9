"""The control plane: every decision about workers.

The registry (``workers``) owns each worker's lifecycle; around it, health probes and circuit
verdicts (``health``, ``circuit``), the calls that read and switch a worker's role
(``worker_control``), conversions (``conversion/``), the autopilot that decides them
(``autopilot/``), the replicas that agree through etcd (``cluster/``) and the publisher that
pushes the registry's snapshots to the data planes and reads their reports (``publisher``).
"""
