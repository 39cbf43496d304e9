"""The data plane: client requests in, a (prefill, decode) pair picked, two legs out.

``front`` is the client side (the server, its connections, and the limits on what clients may
ask), ``path`` the request path, ``routing`` picks the workers from the control side's last
snapshot, ``legs`` sends the two POSTs to the workers, and ``link`` is this side of the channel
to the control side (its messages in, the reports out).
"""
