"""The autopilot: watches both pools and converts a server when the P:D ratio no longer fits.

``signals`` holds what one sample saw, ``policy`` decides (pure code, tested on recorded
samples), ``controller`` samples the router and the workers on an interval and acts.
"""
