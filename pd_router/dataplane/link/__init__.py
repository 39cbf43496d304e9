"""The data plane's end of its link to the control side: the ``channel`` the typed messages of
:mod:`pd_router.wire` travel on, and the ``reports`` a data plane sends back over it.
"""
