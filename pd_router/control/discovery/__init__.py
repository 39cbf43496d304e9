"""Workers discovered from Kubernetes pods (:mod:`.kubernetes`) or a JSON manifest (:mod:`.file`),
joining and leaving through the cluster like the admin API's workers (:mod:`.membership`), with
the pods' role labels kept true to the live roles (:mod:`.labels`); :mod:`.start` starts the
configured provider.
"""
