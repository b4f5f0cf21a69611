"""Broker security for a mesh: a small CA (pki.py) and mosquitto's files (mosquitto.py)."""
