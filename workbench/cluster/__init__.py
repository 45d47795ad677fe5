"""Many engines behind a router: :class:`Cluster`, the :class:`Router` protocol and the routers."""

from workbench.cluster.cache_aware import CacheAware
from workbench.cluster.cluster import Cluster
from workbench.cluster.kv_index import KVBlockIndex
from workbench.cluster.precise_prefix import PrecisePrefix
from workbench.cluster.replica import ReplicaView
from workbench.cluster.result import ClusterResult
from workbench.cluster.router import RoutedRequest, Router, Routing
from workbench.cluster.routers import ROUTERS, LeastRequests, PowerOfTwo, RoundRobin, Session
from workbench.cluster.scorers import WeightedScorers

__all__ = ["ROUTERS", "CacheAware", "Cluster", "ClusterResult", "KVBlockIndex", "LeastRequests", "PowerOfTwo",
           "PrecisePrefix", "ReplicaView", "RoundRobin", "RoutedRequest", "Router", "Routing", "Session",
           "WeightedScorers"]
