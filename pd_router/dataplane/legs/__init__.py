"""The worker side of a data plane: the legs, the two POSTs of every request.

``pool`` keeps keep-alive HTTP/1.1 connections per worker, each a ``connection`` whose answers
httptools parses; ``leg`` sends one leg on the pool and says what its failure means; ``aborts``
reads an abort out of a worker's 2xx answer; ``setup`` builds the pool, the legs and their
headers from the configuration.
"""
