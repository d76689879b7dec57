"""``edge-agent bench fleet``: hundreds of agents on one TLS broker, a deploy to all of them, a
deploy through a broker crash, and a misbehaving version stopped by a staged rollout.

The agents are lightweight, in this exact sense: each is the real MQTT link
(agent/fleet/mqtt.py), the real control plane (agent/fleet/device.py) and the real updater
(agent/update/updater.py, its journal in the agent's own state directory), and its update really
downloads the bundle over HTTP from the fleet's static file server (agent/fleet/ops/fileserver.py),
verifies its signature and hashes (``open_bundle``, as the daemon's verify step does), installs it
into the agent's own store (agent/store), loads it (an ONNX Runtime session of the tiny model, one
intra-op thread) and runs a warm-up batch that fails on NaN or Inf. What an agent skips is the HTTP
inference server and the shadow canary and watch window on live traffic: there is no traffic
(agent/tooling/fleetbench/steps.py says it state by state). Many agents share one process.

Modules: ``bench`` (the phases and the figures), ``agents`` (a process of agents), ``steps`` (an
agent's update steps), ``broker`` (Mosquitto with the fleet's production configuration),
``observer`` (the operator-side view that times the phases), ``bundles`` (the key and the
versions).
"""
