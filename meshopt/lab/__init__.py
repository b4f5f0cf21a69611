"""The network-namespace lab: nodes in namespaces over an emulated underlay.

Modules: ``netns`` (namespace helpers), ``tun`` (TUN devices), ``shaper`` (the pure
per-pair delay/jitter/loss/rate logic) and ``emulator`` (the underlay process,
its spec, launcher and control client).
"""
