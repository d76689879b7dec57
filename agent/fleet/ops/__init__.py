"""The operator's side of fleet control (``edge-agent fleet ...``).

- ``artifacts``: publish verified bundles into an artifact directory and its index;
- ``fileserver``: serve that directory with Range, ETag and If-Range;
- ``pki``, ``broker``, ``workspace``, ``provision``: the fleet's keys and certificates, the
  production Mosquitto configuration and ACL, the operator's workspace and device provisioning;
- ``rollout``: the staged rollout as a state machine (stages, abort rules, rollback), and the
  rollout document it keeps retained on the broker;
- ``operator``, ``deploy``: the operator's MQTT client, and the driver that runs a rollout;
- ``locking``: one writer at a time for the workspace's files.

docs/fleet.md is the operator's guide.
"""
