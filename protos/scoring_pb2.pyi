from protos import model_card_pb2 as _model_card_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Shift(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHIFT_UNSPECIFIED: _ClassVar[Shift]
    SHIFT_NONE: _ClassVar[Shift]
    SHIFT_GRID: _ClassVar[Shift]
    SHIFT_DIAGONAL: _ClassVar[Shift]
    SHIFT_ATROUS: _ClassVar[Shift]

class MapDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MAP_DTYPE_UNSPECIFIED: _ClassVar[MapDtype]
    FLOAT32: _ClassVar[MapDtype]
    FLOAT16: _ClassVar[MapDtype]
SHIFT_UNSPECIFIED: Shift
SHIFT_NONE: Shift
SHIFT_GRID: Shift
SHIFT_DIAGONAL: Shift
SHIFT_ATROUS: Shift
MAP_DTYPE_UNSPECIFIED: MapDtype
FLOAT32: MapDtype
FLOAT16: MapDtype

class RawImage(_message.Message):
    __slots__ = ("data", "height", "width", "channels")
    DATA_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    height: int
    width: int
    channels: int
    def __init__(self, data: _Optional[bytes] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., channels: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("model", "encoded", "raw", "scales", "output_stride", "shift", "flip", "return_maps", "map_dtype", "classes", "cell_top_k", "top_k", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    FLIP_FIELD_NUMBER: _ClassVar[int]
    RETURN_MAPS_FIELD_NUMBER: _ClassVar[int]
    MAP_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    CELL_TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    encoded: bytes
    raw: RawImage
    scales: _containers.RepeatedScalarFieldContainer[int]
    output_stride: int
    shift: Shift
    flip: bool
    return_maps: bool
    map_dtype: MapDtype
    classes: _containers.RepeatedScalarFieldContainer[int]
    cell_top_k: int
    top_k: int
    request_id: str
    def __init__(self, model: _Optional[str] = ..., encoded: _Optional[bytes] = ..., raw: _Optional[_Union[RawImage, _Mapping]] = ..., scales: _Optional[_Iterable[int]] = ..., output_stride: _Optional[int] = ..., shift: _Optional[_Union[Shift, str]] = ..., flip: _Optional[bool] = ..., return_maps: _Optional[bool] = ..., map_dtype: _Optional[_Union[MapDtype, str]] = ..., classes: _Optional[_Iterable[int]] = ..., cell_top_k: _Optional[int] = ..., top_k: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class MapGeometry(_message.Message):
    __slots__ = ("stride_y", "stride_x", "center_y", "center_x", "box_height", "box_width", "scale_factor", "resized_height", "resized_width", "padded_border_rows", "padded_border_cols")
    STRIDE_Y_FIELD_NUMBER: _ClassVar[int]
    STRIDE_X_FIELD_NUMBER: _ClassVar[int]
    CENTER_Y_FIELD_NUMBER: _ClassVar[int]
    CENTER_X_FIELD_NUMBER: _ClassVar[int]
    BOX_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    BOX_WIDTH_FIELD_NUMBER: _ClassVar[int]
    SCALE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    RESIZED_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    RESIZED_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PADDED_BORDER_ROWS_FIELD_NUMBER: _ClassVar[int]
    PADDED_BORDER_COLS_FIELD_NUMBER: _ClassVar[int]
    stride_y: float
    stride_x: float
    center_y: float
    center_x: float
    box_height: float
    box_width: float
    scale_factor: float
    resized_height: int
    resized_width: int
    padded_border_rows: int
    padded_border_cols: int
    def __init__(self, stride_y: _Optional[float] = ..., stride_x: _Optional[float] = ..., center_y: _Optional[float] = ..., center_x: _Optional[float] = ..., box_height: _Optional[float] = ..., box_width: _Optional[float] = ..., scale_factor: _Optional[float] = ..., resized_height: _Optional[int] = ..., resized_width: _Optional[int] = ..., padded_border_rows: _Optional[int] = ..., padded_border_cols: _Optional[int] = ...) -> None: ...

class ScaleMap(_message.Message):
    __slots__ = ("scale", "scores", "classes", "cell_top_k_indices", "cell_top_k_scores", "geometry", "height", "width", "tiling")
    SCALE_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    CELL_TOP_K_INDICES_FIELD_NUMBER: _ClassVar[int]
    CELL_TOP_K_SCORES_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    TILING_FIELD_NUMBER: _ClassVar[int]
    scale: int
    scores: Tensor
    classes: _containers.RepeatedScalarFieldContainer[int]
    cell_top_k_indices: Tensor
    cell_top_k_scores: Tensor
    geometry: MapGeometry
    height: int
    width: int
    tiling: Tiling
    def __init__(self, scale: _Optional[int] = ..., scores: _Optional[_Union[Tensor, _Mapping]] = ..., classes: _Optional[_Iterable[int]] = ..., cell_top_k_indices: _Optional[_Union[Tensor, _Mapping]] = ..., cell_top_k_scores: _Optional[_Union[Tensor, _Mapping]] = ..., geometry: _Optional[_Union[MapGeometry, _Mapping]] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., tiling: _Optional[_Union[Tiling, _Mapping]] = ...) -> None: ...

class Tiling(_message.Message):
    __slots__ = ("tiles", "halo_px", "exact", "canvas_height", "canvas_width")
    TILES_FIELD_NUMBER: _ClassVar[int]
    HALO_PX_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    CANVAS_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    CANVAS_WIDTH_FIELD_NUMBER: _ClassVar[int]
    tiles: int
    halo_px: int
    exact: bool
    canvas_height: int
    canvas_width: int
    def __init__(self, tiles: _Optional[int] = ..., halo_px: _Optional[int] = ..., exact: _Optional[bool] = ..., canvas_height: _Optional[int] = ..., canvas_width: _Optional[int] = ...) -> None: ...

class Label(_message.Message):
    __slots__ = ("index", "label", "probability")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    index: int
    label: str
    probability: float
    def __init__(self, index: _Optional[int] = ..., label: _Optional[str] = ..., probability: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "preprocess_ms", "inference_ms", "postprocess_ms", "total_ms", "planning_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_MS_FIELD_NUMBER: _ClassVar[int]
    POSTPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PLANNING_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    preprocess_ms: float
    inference_ms: float
    postprocess_ms: float
    total_ms: float
    planning_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., preprocess_ms: _Optional[float] = ..., inference_ms: _Optional[float] = ..., postprocess_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., planning_ms: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("model", "request_id", "image_height", "image_width", "maps", "top_k", "timings", "execution_provider", "output_stride", "shift", "warnings")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAPS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    image_height: int
    image_width: int
    maps: _containers.RepeatedCompositeFieldContainer[ScaleMap]
    top_k: _containers.RepeatedCompositeFieldContainer[Label]
    timings: Timings
    execution_provider: str
    output_stride: int
    shift: Shift
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., image_height: _Optional[int] = ..., image_width: _Optional[int] = ..., maps: _Optional[_Iterable[_Union[ScaleMap, _Mapping]]] = ..., top_k: _Optional[_Iterable[_Union[Label, _Mapping]]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., execution_provider: _Optional[str] = ..., output_stride: _Optional[int] = ..., shift: _Optional[_Union[Shift, str]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("name", "classes", "output_stride", "precision", "path", "output_strides", "min_scale", "max_scale", "default_scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STRIDES_FIELD_NUMBER: _ClassVar[int]
    MIN_SCALE_FIELD_NUMBER: _ClassVar[int]
    MAX_SCALE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    classes: int
    output_stride: int
    precision: str
    path: str
    output_strides: _containers.RepeatedScalarFieldContainer[int]
    min_scale: int
    max_scale: int
    default_scale: int
    def __init__(self, name: _Optional[str] = ..., classes: _Optional[int] = ..., output_stride: _Optional[int] = ..., precision: _Optional[str] = ..., path: _Optional[str] = ..., output_strides: _Optional[_Iterable[int]] = ..., min_scale: _Optional[int] = ..., max_scale: _Optional[int] = ..., default_scale: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelSummary]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelSummary, _Mapping]]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...
