"""The data plane: client requests in, a (prefill, decode) pair picked, two legs out.

``listener`` accepts and limits client connections, ``requests`` parses bodies once,
``policies`` (with ``radix_tree``) picks workers, ``proxy`` runs the request path over
``upstream`` legs on the keep-alive pool of ``http1``/``http1_conn``.
"""
