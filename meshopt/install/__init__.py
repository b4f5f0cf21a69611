"""Owned route and policy-rule installation (pyroute2 ``AsyncIPRoute``).

``model`` says what we want and plans the changes (pure); ``routes`` talks netlink;
``tuning`` computes per-route TCP settings for a WireGuard path.
"""

from meshopt.install.model import (
    BULK_RULE_PRIORITY,
    BULK_TABLE,
    FAST_RULE_PRIORITY,
    FAST_TABLE,
    RTPROT_MESHOPT,
    DesiredRoute,
    DesiredRule,
    Plan,
    RulePlan,
    bulk_rules,
    fast_rules,
    plan,
    plan_rules,
)
from meshopt.install.routes import (
    InstallError,
    ReconcileResult,
    RouteInstaller,
    available_congestion_control,
)
from meshopt.install.tuning import TcpTuning, tcp_tuning

__all__ = [
    "BULK_RULE_PRIORITY",
    "BULK_TABLE",
    "FAST_RULE_PRIORITY",
    "FAST_TABLE",
    "RTPROT_MESHOPT",
    "DesiredRoute",
    "DesiredRule",
    "InstallError",
    "Plan",
    "ReconcileResult",
    "RouteInstaller",
    "RulePlan",
    "TcpTuning",
    "available_congestion_control",
    "bulk_rules",
    "fast_rules",
    "plan",
    "plan_rules",
    "tcp_tuning",
]
