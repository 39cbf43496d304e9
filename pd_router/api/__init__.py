"""The HTTP application: routes, middleware, and the admin and info handlers.

``server`` builds the aiohttp application around one ``state.Router``; the other modules are the
handlers of one area each (workers, conversions, autopilot, dashboard, loads, metrics, info).
"""
