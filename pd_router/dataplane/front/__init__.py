"""The client side of a data plane: a lean HTTP/1.1 server on httptools' parser.

Every client connection of the router arrives here, in a one-process router and in each data
plane of a multi-process one. The generation endpoints are served in place (:mod:`.dispatch`
hands them to the request path); every other request (admin API, info, metrics, dashboard) is
relayed, as it came, to the router's aiohttp application on a Unix socket (:mod:`.relay`),
which is in this process or in the control process.

The server exists for the cost of a request: a generation request through aiohttp's server
took about 40% of a data plane's CPU (its protocol, application, router and response
objects); here it is parsed by httptools and answered with a head built in one string.

- :mod:`.request`: one parsed request.
- :mod:`.connection`: one client connection (parsing, pipelining, timeouts, flow control).
- :mod:`.reply`: the answer to one request (whole or streamed).
- :mod:`.dispatch`: request ids, body admission, CORS, metrics, errors, routing.
- :mod:`.relay`: every other request, to the application.
- :mod:`.server`: the listening socket, the connection cap, a graceful stop.
- :mod:`.listener`: the client side's limits (timeouts, the cap on open connections).
- :mod:`.admission`: the size of one body and the budget of all bodies in flight.
- :mod:`.concurrency`: generation requests by number and rate (the ``[admission]`` limits).
"""
