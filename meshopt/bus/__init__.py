"""The MQTT bus between agents and controllers: topics, typed messages, signing, client.

See ``meshopt.bus.topics`` for the topic layout and ``meshopt.bus.messages`` for the
message reference (also in agents/TOPICS.md).
"""
