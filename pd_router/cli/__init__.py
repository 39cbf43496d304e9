"""The ``pd-router`` command: serving (its help, usage errors, who can use the admin API), the
admin client (status, convert and its progress, autopilot), the demo, peer-compatible flags."""
