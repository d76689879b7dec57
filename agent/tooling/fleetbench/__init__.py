"""``edge-agent bench fleet``: many lightweight agents on one TLS broker with per-device
credentials, driven by the operator's staged rollouts (issue 17's benchmark).

Modules: ``agents`` (the lightweight agent: the real MQTT link, control plane, updater and store,
steps without a serving path), ``bench`` (the broker, the file server, the phases and the
figures).
"""
