"""`scoremap-score --tiled --engine ray`: a large image's tiles scored by Ray actors holding --local's pipeline.

The driver reads the image, plans, stitches, writes the Zarr map and the tile journal exactly as
with --local (clients.slides.run); only the ScoreRequests go to the actors, as serialized protos,
so a resumed run and its map are the local path's. Ray is joined or started by
clients.batch.ray_engine.connect, and sized as its actor pool is: one actor per GPU, else per core.
"""

from __future__ import annotations

import threading

import grpc

from clients.api.errors import ScoremapError
from clients.api.settings import ClientSettings
from clients.batch.ray_engine import connect, pool_size
from protos import model_card_pb2, scoring_pb2

__all__ = ["RayTileScorer", "TileScorer", "ACTOR_RESTARTS"]

# A lost actor is restarted and its tile sent again this many times (the driver writes, so a retry is harmless).
ACTOR_RESTARTS = 3


class TileScorer:
    """A Ray actor: the --local pipeline, answering serialized ScoreRequests with serialized responses."""

    def __init__(self, model_path: str, *, intra_op_threads: int, client_settings: ClientSettings) -> None:
        from clients.batch.local import LocalScorer  # imports the server package: only in the actors
        from server.settings import Settings

        self._scorer = LocalScorer([model_path], settings=Settings(intra_op_threads=intra_op_threads),
                                   client_settings=client_settings)

    def score(self, request: bytes, timeout: float | None) -> bytes | tuple[str, str, float | None]:
        """The response's bytes, or a refusal as (code, message, retry after): rebuilt on the driver as
        the ScoremapError --local raises, not wrapped in Ray's task error."""
        try:
            return self._scorer.score_request(scoring_pb2.ScoreRequest.FromString(request),
                                              timeout=timeout).SerializeToString()
        except ScoremapError as error:
            return error.code.name, error.message, error.retry_after_s

    def card(self, name: str) -> bytes | tuple[str, str, float | None]:
        try:
            return self._scorer.model(name).SerializeToString()
        except ScoremapError as error:
            return error.code.name, error.message, error.retry_after_s


def _answer(answer: bytes | tuple[str, str, float | None]) -> bytes:
    if isinstance(answer, tuple):
        code, message, retry_after_s = answer
        raise ScoremapError(grpc.StatusCode[code], message, retry_after_s=retry_after_s)
    return answer


class RayTileScorer:
    """A scorer as LocalScorer is to clients.slides.run (score_request, model, close), whose requests go to
    an actor pool; each call goes to the actor with the fewest in flight, each actor takes `per_actor` at once."""

    def __init__(self, model_path: str, *, address: str | None = None, actors: int = 0, per_actor: int = 1,
                 client_settings: ClientSettings | None = None) -> None:
        self._started_ray = connect(address)
        import ray

        self._ray = ray
        size, gpus, threads = pool_size(ray)
        actor = ray.remote(TileScorer).options(num_cpus=threads, num_gpus=gpus, max_concurrency=per_actor,
                                               max_restarts=ACTOR_RESTARTS, max_task_retries=ACTOR_RESTARTS)
        self._actors = [actor.remote(model_path, intra_op_threads=threads,
                                     client_settings=client_settings or ClientSettings())
                        for _ in range(actors or size)]
        self._busy = [0] * len(self._actors)
        self._lock = threading.Lock()
        self.in_flight = len(self._actors) * per_actor  # the tiles worth keeping in flight to fill the pool

    def score_request(self, request: scoring_pb2.ScoreRequest, *,
                      timeout: float | None = None) -> scoring_pb2.ScoreResponse:
        with self._lock:
            index = min(range(len(self._actors)), key=self._busy.__getitem__)
            self._busy[index] += 1
        try:
            answer = self._ray.get(self._actors[index].score.remote(request.SerializeToString(), timeout))
        except self._ray.exceptions.RayActorError as lost:  # restarted ACTOR_RESTARTS times already
            raise ScoremapError(grpc.StatusCode.UNAVAILABLE,
                                f"a Ray actor scoring tiles was lost ({lost.__class__.__name__}); "
                                "re-run the same command to resume") from lost
        finally:
            with self._lock:
                self._busy[index] -= 1
        return scoring_pb2.ScoreResponse.FromString(_answer(answer))

    def model(self, name: str = "") -> model_card_pb2.ModelCard:
        return model_card_pb2.ModelCard.FromString(_answer(self._ray.get(self._actors[0].card.remote(name))))

    def close(self) -> None:
        """End the actors (tiles in flight end with them, as on Ctrl-C), and Ray if this scorer started it."""
        for actor in self._actors:
            self._ray.kill(actor)
        if self._started_ray:
            self._ray.shutdown()
