"""The Python API: ScoremapClient, its options, results, errors and settings, and heatmaps of its results."""

from clients.api.client import ScoremapClient
from clients.api.errors import ScoremapError
from clients.api.options import ScoreOptions
from clients.api.results import Geometry, Prediction, ScaleResult, ScoreResult
from clients.api.settings import ClientSettings

__all__ = ["ScoremapClient", "ScoremapError", "ScoreOptions", "ScoreResult", "ScaleResult",
           "Geometry", "Prediction", "ClientSettings"]
