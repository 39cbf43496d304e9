"""The HTTP application: routes, middleware, and the admin and info handlers.

``server`` builds the aiohttp application (routes and middleware), ``errors`` turns what a handler
raised into its response, ``keys`` names the collaborators handlers read from the application;
the other modules are the handlers of one area each (workers, conversions, autopilot, dashboard,
loads, metrics, info).
"""
