"""Fleet control over MQTT (design §5.3): topics, documents, the broker link, the device side."""
