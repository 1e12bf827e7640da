"""scoremap's Pipeline behind a real Triton server, through PyTriton (the `triton` extra).

Triton's front end (its gRPC/HTTP endpoints, metrics, model control, rate limiting) with
scoremap's dense scoring behind it, for fleets that run every model through Triton yet want the
resizing, shifted passes, stitching and top-k of scoremap-serve. The tensors
and parameters are those of server/edges/open_inference.py (KServe v2 over gRPC and HTTP), so a tritonclient program gets the same answer
from either server. Triton declares outputs up front, hence the scales it may return are fixed
when binding: SCORES_<s> for each; requests choose among them with the `scales` parameter.

The exported repository (`scoremap-export triton`) is the other way onto Triton: the bare graph
on its onnxruntime backend, the dense-scoring steps left to the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from pytriton.model_config import ModelConfig, Tensor
from pytriton.proxy.types import Request
from pytriton.triton import Triton

from protos import scoring_pb2
from server.edges.open_inference import (CELL_TOP_K_INDICES, CELL_TOP_K_SCORES, IMAGE_INPUT, SCORES, TOP_K_INDICES, TOP_K_LABELS,
                           TOP_K_PROBABILITIES, apply_parameters, output_arrays)
from server.scoring.pipeline import Pipeline


def _score(pipeline: Pipeline, model: str, scales: Sequence[int], request: Request) -> dict[str, np.ndarray]:
    encoded = bytes(request[IMAGE_INPUT].reshape(-1)[0])
    score = scoring_pb2.ScoreRequest(model=model, scales=scales, return_maps=True, encoded=encoded)
    apply_parameters(score, request.parameters or {})
    return output_arrays(pipeline.score(score))


def _infer(pipeline: Pipeline, model: str, scales: Sequence[int],
           requests: list[Request]) -> list[dict[str, np.ndarray]]:
    return [_score(pipeline, model, scales, request) for request in requests]


def bind(triton: Triton, pipeline: Pipeline, *, model: str, scales: Sequence[int], instances: int = 1) -> None:
    """Serve `pipeline`'s `model` on `triton` under the same name, IMAGE in, top-k and SCORES_<s> out."""
    scale_outputs = [Tensor(name=f"{prefix}{scale}", dtype=dtype, shape=(-1, -1, -1))
                     for scale in scales for prefix, dtype in ((SCORES, np.float32), (CELL_TOP_K_INDICES, np.int32),
                                                               (CELL_TOP_K_SCORES, np.float32))]
    triton.bind(
        model_name=model,
        infer_func=[functools.partial(_infer, pipeline, model, list(scales))] * instances,
        inputs=[Tensor(name=IMAGE_INPUT, dtype=bytes, shape=(1,))],
        outputs=[Tensor(name=TOP_K_INDICES, dtype=np.int32, shape=(-1,)),
                 Tensor(name=TOP_K_PROBABILITIES, dtype=np.float32, shape=(-1,)),
                 Tensor(name=TOP_K_LABELS, dtype=bytes, shape=(-1,)), *scale_outputs],
        config=ModelConfig(batching=False),  # one image per request; the Pipeline batches passes across requests
        strict=False,
    )
