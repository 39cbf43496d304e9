"""Which workers a request goes to: the pools a snapshot makes and how each picks.

``snapshot`` holds the pools the control side's last snapshot made, ``pools`` what the request
path picks from and the pick of one pool, ``policies`` (with ``radix_tree`` for cache-aware
routing) picks a worker of a pool, ``target`` is a worker as they all see it, ``pairs`` keeps
apart the pairs whose rendezvous failed, ``retry`` says how many attempts a request gets and the
pause before each.
"""
