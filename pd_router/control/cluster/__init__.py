"""Several router replicas in front of one cluster, agreeing through etcd.

Without a ``[cluster]`` section a router keeps its state in memory (:class:`LocalCluster`).
With one, every replica mirrors the shared worker records into its own registry and coordinates
conversions, removals and the autopilot's leadership with the others (:class:`EtcdCluster`).
Health, circuits and in-flight counts stay each replica's own. The key layout and the shared
record are in :mod:`pd_protocol.cluster`.
"""
