"""The controller: telemetry in, a graph, anti-flap routes, signed route sets out."""
