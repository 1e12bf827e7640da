"""scoremap clients: the Python API, the batch scorer and the load tester."""

from clients.api import ScoremapClient
from clients.errors import ScoremapError
from clients.options import ScoreOptions
from clients.results import Geometry, Prediction, ScaleResult, ScoreResult
from clients.settings import ClientSettings

__all__ = ["ScoremapClient", "ScoremapError", "ScoreOptions", "ScoreResult", "ScaleResult",
           "Geometry", "Prediction", "ClientSettings"]
