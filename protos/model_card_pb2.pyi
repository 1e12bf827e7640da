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

class ModelCard(_message.Message):
    __slots__ = ("name", "labels", "preprocessing", "training_height", "training_width", "output_stride", "receptive_field", "scores_name", "output_kind", "source", "verification", "precision", "default_scale", "size_multiple", "native_output_stride")
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
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., preprocessing: _Optional[_Union[Preprocessing, _Mapping]] = ..., training_height: _Optional[int] = ..., training_width: _Optional[int] = ..., output_stride: _Optional[int] = ..., receptive_field: _Optional[_Union[ReceptiveField, _Mapping]] = ..., scores_name: _Optional[str] = ..., output_kind: _Optional[_Union[OutputKind, str]] = ..., source: _Optional[str] = ..., verification: _Optional[_Union[Verification, _Mapping]] = ..., precision: _Optional[_Union[Precision, str]] = ..., default_scale: _Optional[int] = ..., size_multiple: _Optional[int] = ..., native_output_stride: _Optional[int] = ...) -> None: ...
