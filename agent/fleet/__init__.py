"""Fleet control over MQTT: the broker link, the documents and topics, the device control plane."""
