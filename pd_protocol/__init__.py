"""The PD control protocol as the router and the servers share it (see :mod:`pd_protocol.wire`).

A package of its own so that neither side imports the other: ``pd_router`` is the client of
these endpoints, ``server_patch`` (on SGLang) and ``pd_worker`` serve them.
"""
