"""scoremap clients: the Python API (api/), the batch scorer (batch/) and the load tester (loadtest/)."""

from clients.api import (ClientSettings, Geometry, Prediction, ScaleResult, ScoremapClient, ScoremapError,
                         ScoreOptions, ScoreResult)

__all__ = ["ScoremapClient", "ScoremapError", "ScoreOptions", "ScoreResult", "ScaleResult",
           "Geometry", "Prediction", "ClientSettings"]
