"""Offline discrete-event simulation of a mesh: probes, metric, policy and routes."""
