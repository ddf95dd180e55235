"""Token routing (TREAD): policies, route specs and the block runner. Knows nothing of backbones."""

from routing.errors import ConfigError
from routing.policy import POLICIES, RoutingPolicy, Selection, build_policy
from routing.route import Route, resolve_routes
from routing.router import Router

__all__ = ["ConfigError", "POLICIES", "Route", "Router", "RoutingPolicy", "Selection", "build_policy", "resolve_routes"]
