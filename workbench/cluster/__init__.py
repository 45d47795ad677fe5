"""Many engines behind a router: :class:`Cluster`, the :class:`Router` protocol and the routers."""

from workbench.cluster.cluster import Cluster
from workbench.cluster.replica import ReplicaView
from workbench.cluster.result import ClusterResult
from workbench.cluster.router import RoutedRequest, Router, Routing
from workbench.cluster.routers import ROUTERS, LeastRequests, PowerOfTwo, RoundRobin, Session

__all__ = ["ROUTERS", "Cluster", "ClusterResult", "LeastRequests", "PowerOfTwo", "ReplicaView", "RoundRobin",
           "RoutedRequest", "Router", "Routing", "Session"]
