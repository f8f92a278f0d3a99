"""The application services: what torpor does, independent of where it runs.

Each service talks to the world through the ports in ``torpor.ports`` only; the
composition root (``actors.wiring``) picks the adapters. Nothing here imports Ray, Redis,
boto3 or the HTTP framework.
"""
