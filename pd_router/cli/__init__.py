"""The ``pd-router`` command: serving, the admin client, the demo, peer-compatible flags."""
