"""The request path: one generation request from its parsed body to the client's answer.

``proxy`` runs it (pair selection, bootstrap injection, streaming relay, retries), ``requests``
parses and checks the bodies, ``fanout`` serves ``n > 1`` as ``n`` requests, ``logprobs`` merges
the prefill's input logprobs into the answer, and ``collaborators`` bundles what the path reaches
(:class:`~pd_router.dataplane.path.collaborators.PathCollaborators`).
"""
