from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYOUT_UNSPECIFIED: _ClassVar[Layout]
    LAYOUT_NCHW: _ClassVar[Layout]
    LAYOUT_NHWC: _ClassVar[Layout]

class InputDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INPUT_DTYPE_UNSPECIFIED: _ClassVar[InputDtype]
    INPUT_DTYPE_FLOAT32: _ClassVar[InputDtype]
    INPUT_DTYPE_FLOAT16: _ClassVar[InputDtype]
    INPUT_DTYPE_UINT8: _ClassVar[InputDtype]

class ChannelOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHANNEL_ORDER_UNSPECIFIED: _ClassVar[ChannelOrder]
    CHANNEL_ORDER_RGB: _ClassVar[ChannelOrder]
    CHANNEL_ORDER_BGR: _ClassVar[ChannelOrder]

class OutputKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_KIND_UNSPECIFIED: _ClassVar[OutputKind]
    OUTPUT_KIND_LOGITS: _ClassVar[OutputKind]
    OUTPUT_KIND_PROBABILITIES: _ClassVar[OutputKind]

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_UNSPECIFIED: _ClassVar[Precision]
    PRECISION_FP32: _ClassVar[Precision]
    PRECISION_FP16: _ClassVar[Precision]
    PRECISION_INT8: _ClassVar[Precision]

class Int8Weights(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INT8_WEIGHTS_UNSPECIFIED: _ClassVar[Int8Weights]
    INT8_WEIGHTS_PAIR_BOUNDED: _ClassVar[Int8Weights]
    INT8_WEIGHTS_FULL: _ClassVar[Int8Weights]
LAYOUT_UNSPECIFIED: Layout
LAYOUT_NCHW: Layout
LAYOUT_NHWC: Layout
INPUT_DTYPE_UNSPECIFIED: InputDtype
INPUT_DTYPE_FLOAT32: InputDtype
INPUT_DTYPE_FLOAT16: InputDtype
INPUT_DTYPE_UINT8: InputDtype
CHANNEL_ORDER_UNSPECIFIED: ChannelOrder
CHANNEL_ORDER_RGB: ChannelOrder
CHANNEL_ORDER_BGR: ChannelOrder
OUTPUT_KIND_UNSPECIFIED: OutputKind
OUTPUT_KIND_LOGITS: OutputKind
OUTPUT_KIND_PROBABILITIES: OutputKind
PRECISION_UNSPECIFIED: Precision
PRECISION_FP32: Precision
PRECISION_FP16: Precision
PRECISION_INT8: Precision
INT8_WEIGHTS_UNSPECIFIED: Int8Weights
INT8_WEIGHTS_PAIR_BOUNDED: Int8Weights
INT8_WEIGHTS_FULL: Int8Weights

class Preprocessing(_message.Message):
    __slots__ = ("input_name", "layout", "dtype", "channel_order", "pixel_scale", "mean", "std", "resize_filter")
    INPUT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_ORDER_FIELD_NUMBER: _ClassVar[int]
    PIXEL_SCALE_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FILTER_FIELD_NUMBER: _ClassVar[int]
    input_name: str
    layout: Layout
    dtype: InputDtype
    channel_order: ChannelOrder
    pixel_scale: float
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    resize_filter: str
    def __init__(self, input_name: _Optional[str] = ..., layout: _Optional[_Union[Layout, str]] = ..., dtype: _Optional[_Union[InputDtype, str]] = ..., channel_order: _Optional[_Union[ChannelOrder, str]] = ..., pixel_scale: _Optional[float] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ..., resize_filter: _Optional[str] = ...) -> None: ...

class ReceptiveField(_message.Message):
    __slots__ = ("size", "center_y", "center_x")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CENTER_Y_FIELD_NUMBER: _ClassVar[int]
    CENTER_X_FIELD_NUMBER: _ClassVar[int]
    size: int
    center_y: float
    center_x: float
    def __init__(self, size: _Optional[int] = ..., center_y: _Optional[float] = ..., center_x: _Optional[float] = ...) -> None: ...

class Verification(_message.Message):
    __slots__ = ("max_abs_diff", "tolerance", "samples", "passed", "argmax_agreement", "reference")
    MAX_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    max_abs_diff: float
    tolerance: float
    samples: int
    passed: bool
    argmax_agreement: float
    reference: str
    def __init__(self, max_abs_diff: _Optional[float] = ..., tolerance: _Optional[float] = ..., samples: _Optional[int] = ..., passed: _Optional[bool] = ..., argmax_agreement: _Optional[float] = ..., reference: _Optional[str] = ...) -> None: ...

class Agreement(_message.Message):
    __slots__ = ("images", "sides", "top1_agreement", "image_top1_agreement", "max_probability_diff", "mean_probability_diff", "map_correlation", "mean_map_correlation")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SIDES_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_PROBABILITY_DIFF_FIELD_NUMBER: _ClassVar[int]
    MEAN_PROBABILITY_DIFF_FIELD_NUMBER: _ClassVar[int]
    MAP_CORRELATION_FIELD_NUMBER: _ClassVar[int]
    MEAN_MAP_CORRELATION_FIELD_NUMBER: _ClassVar[int]
    images: int
    sides: _containers.RepeatedScalarFieldContainer[int]
    top1_agreement: float
    image_top1_agreement: float
    max_probability_diff: float
    mean_probability_diff: float
    map_correlation: float
    mean_map_correlation: float
    def __init__(self, images: _Optional[int] = ..., sides: _Optional[_Iterable[int]] = ..., top1_agreement: _Optional[float] = ..., image_top1_agreement: _Optional[float] = ..., max_probability_diff: _Optional[float] = ..., mean_probability_diff: _Optional[float] = ..., map_correlation: _Optional[float] = ..., mean_map_correlation: _Optional[float] = ...) -> None: ...

class CalibrationTrial(_message.Message):
    __slots__ = ("method", "calibration")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    method: str
    calibration: Agreement
    def __init__(self, method: _Optional[str] = ..., calibration: _Optional[_Union[Agreement, _Mapping]] = ...) -> None: ...

class Quantization(_message.Message):
    __slots__ = ("method", "calibration_source", "calibration_images", "held_out_images", "calibration", "held_out", "min_top1_agreement", "min_map_correlation", "trials", "worst_layer", "warning", "float_ops", "float_layers", "weights")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_IMAGES_FIELD_NUMBER: _ClassVar[int]
    HELD_OUT_IMAGES_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    HELD_OUT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    MIN_MAP_CORRELATION_FIELD_NUMBER: _ClassVar[int]
    TRIALS_FIELD_NUMBER: _ClassVar[int]
    WORST_LAYER_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    FLOAT_OPS_FIELD_NUMBER: _ClassVar[int]
    FLOAT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    method: str
    calibration_source: str
    calibration_images: _containers.RepeatedScalarFieldContainer[str]
    held_out_images: _containers.RepeatedScalarFieldContainer[str]
    calibration: Agreement
    held_out: Agreement
    min_top1_agreement: float
    min_map_correlation: float
    trials: _containers.RepeatedCompositeFieldContainer[CalibrationTrial]
    worst_layer: str
    warning: str
    float_ops: _containers.RepeatedScalarFieldContainer[str]
    float_layers: _containers.RepeatedScalarFieldContainer[str]
    weights: Int8Weights
    def __init__(self, method: _Optional[str] = ..., calibration_source: _Optional[str] = ..., calibration_images: _Optional[_Iterable[str]] = ..., held_out_images: _Optional[_Iterable[str]] = ..., calibration: _Optional[_Union[Agreement, _Mapping]] = ..., held_out: _Optional[_Union[Agreement, _Mapping]] = ..., min_top1_agreement: _Optional[float] = ..., min_map_correlation: _Optional[float] = ..., trials: _Optional[_Iterable[_Union[CalibrationTrial, _Mapping]]] = ..., worst_layer: _Optional[str] = ..., warning: _Optional[str] = ..., float_ops: _Optional[_Iterable[str]] = ..., float_layers: _Optional[_Iterable[str]] = ..., weights: _Optional[_Union[Int8Weights, str]] = ...) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("name", "labels", "preprocessing", "training_height", "training_width", "output_stride", "receptive_field", "scores_name", "output_kind", "source", "verification", "precision", "default_scale", "size_multiple", "native_output_stride", "quantization")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESSING_FIELD_NUMBER: _ClassVar[int]
    TRAINING_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    TRAINING_WIDTH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    RECEPTIVE_FIELD_FIELD_NUMBER: _ClassVar[int]
    SCORES_NAME_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SIZE_MULTIPLE_FIELD_NUMBER: _ClassVar[int]
    NATIVE_OUTPUT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    preprocessing: Preprocessing
    training_height: int
    training_width: int
    output_stride: int
    receptive_field: ReceptiveField
    scores_name: str
    output_kind: OutputKind
    source: str
    verification: Verification
    precision: Precision
    default_scale: int
    size_multiple: int
    native_output_stride: int
    quantization: Quantization
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., preprocessing: _Optional[_Union[Preprocessing, _Mapping]] = ..., training_height: _Optional[int] = ..., training_width: _Optional[int] = ..., output_stride: _Optional[int] = ..., receptive_field: _Optional[_Union[ReceptiveField, _Mapping]] = ..., scores_name: _Optional[str] = ..., output_kind: _Optional[_Union[OutputKind, str]] = ..., source: _Optional[str] = ..., verification: _Optional[_Union[Verification, _Mapping]] = ..., precision: _Optional[_Union[Precision, str]] = ..., default_scale: _Optional[int] = ..., size_multiple: _Optional[int] = ..., native_output_stride: _Optional[int] = ..., quantization: _Optional[_Union[Quantization, _Mapping]] = ...) -> None: ...
