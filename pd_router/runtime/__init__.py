"""What builds the router and runs its processes: the composition root (``router``), serving
in this process (``serve``), the control process of ``--workers N`` (``processes``), a data
plane and its process's main (``dataplane_process``), the application's Unix socket
(``app_socket``) and what a stop signal does first (``signals``).

It sits above ``api`` (the HTTP handlers) and the planes, and below ``cli``.
"""
