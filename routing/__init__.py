"""Token routing (TREAD): policies, route specs and the block runner. Knows nothing of backbones."""

from routing.errors import ConfigError, FileError
from routing.policy import POLICIES, ForceKeep, RoutingPolicy, Selection, build_policy
from routing.route import Route, resolve_routes
from routing.router import Router, count_flops, routed_flops

__all__ = ["ConfigError", "FileError", "ForceKeep", "POLICIES", "Route", "Router", "RoutingPolicy", "Selection", "build_policy", "count_flops", "resolve_routes", "routed_flops"]
