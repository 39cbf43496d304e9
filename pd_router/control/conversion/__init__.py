"""Role conversion: drain a worker, switch its role in process, verify, put it back.

``manager`` runs a conversion through the registry's states, ``protocols`` drains and switches
over the native and the extension protocol, ``history`` keeps the records and metrics.
"""
