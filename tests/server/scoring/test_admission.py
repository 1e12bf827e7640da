"""Memory admission with convert.profile's prediction: batches cut to fit, impossible requests refused."""

import grpc
import numpy as np
import pytest

from convert.memory_model import Device
from convert.profile import largest_batch, profile_model
from server.errors import Refusal, ScoringError


def predicted(path: str, side: int, batch: int = 1, device: Device = Device.CPU) -> int:
    return profile_model(path, height=side, width=side, batch=batch, device=device).predicted_peak_bytes


@pytest.fixture(scope="module")
def device() -> Device:
    """The device a server started here predicts its plans for: the one its engine picks (CUDA's terms add
    ~140 MiB of session state and workspace to a tiny net), so budgets are sized from it."""
    from server.engine.providers import Engine
    from server.settings import Settings

    return Engine(Settings(warm_up=False, intra_op_threads=1)).device


def test_oversized_request_is_refused_with_the_numbers(kit, tiny_model_path, device):
    budget = (predicted(tiny_model_path, 96, device=device) + predicted(tiny_model_path, 128, device=device)) // 2
    fits = max(side for side in range(32, 2049, 32) if predicted(tiny_model_path, side, device=device) <= budget)
    assert fits == 96
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    with kit.serving([tiny_model_path], memory_budget_bytes=budget) as (server, _port, stub):
        assert server.pipeline.engine.budget.device is device
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(kit.raw_request(pixels, scales=[64, 512]))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = caught.value.details()
        assert f"needs a predicted {predicted(tiny_model_path, 512, device=device)} bytes" in details
        assert f"the memory budget is {budget} bytes" in details
        assert "the largest scale that fits is 96" in details
        assert stub.Score(kit.raw_request(pixels, scales=[96])).maps  # what fits still runs


def test_batches_are_cut_to_what_fits(kit, tiny_model_path, device):
    """Scale 64 at stride 16 runs 4 shifted passes of a 96x96 canvas (64 + the passes' 16 px slack,
    rounded to the stride) per orientation: a budget of 4 such inputs runs one orientation at a time."""
    budget = predicted(tiny_model_path, 96, batch=4, device=device)
    assert largest_batch(tiny_model_path, height=96, width=96, budget_bytes=budget, device=device) == 4
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    with kit.serving([tiny_model_path], memory_budget_bytes=budget, metrics_port=0, max_batch=8,
                     max_queue_delay_ms=50) as (server, _port, stub):
        assert server.pipeline.engine.budget.device is device
        stub.Score(kit.raw_request(pixels, scales=[64], output_stride=16, flip=True))  # 2 items of 4 passes
        registry = server.metrics.registry
        count = registry.get_sample_value("scoremap_batch_size_count", {"model": "tiny"})
        total = registry.get_sample_value("scoremap_batch_size_sum", {"model": "tiny"})
        largest = registry.get_sample_value("scoremap_batch_predicted_bytes_sum", {"model": "tiny"})
    assert total == 2 and count == 2  # two batches of one item, never both at once
    assert largest == 2 * budget


def test_the_budget_is_split_between_models(tiny_model_path, coordinate_model_path):
    from server.scoring.pipeline import Pipeline
    from server.settings import Settings

    pipeline = Pipeline([tiny_model_path, coordinate_model_path],
                        settings=Settings(warm_up=False, intra_op_threads=1, memory_budget_bytes=10_000_001))
    try:
        assert [pipeline._model(name).plan_memory.budget_bytes for name in ("tiny", "coords")] == [5_000_000] * 2
    finally:
        pipeline.close()


def test_a_model_file_removed_while_serving_changes_nothing(kit, tiny_model_path):
    """Admission and the batch metrics profile the graph loaded at start, not the file."""
    import os

    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    with kit.serving([tiny_model_path], metrics_port=0) as (server, _port, stub):
        assert stub.Score(kit.raw_request(pixels, scales=[64]), timeout=10).maps
        os.remove(tiny_model_path)
        for scale in (96, 128):  # sizes never profiled before the file went away
            assert stub.Score(kit.raw_request(pixels, scales=[scale]), timeout=10).maps
        count = server.metrics.registry.get_sample_value("scoremap_batch_predicted_bytes_count", {"model": "tiny"})
    assert count == 3


def test_each_admission_owns_its_cache(tiny_model_path):
    import gc
    import weakref

    import onnx

    from server.memory.device import PlanMemory

    admission = PlanMemory(onnx.load(tiny_model_path), budget_bytes=None)
    assert admission.predicted_bytes(64, 64) == predicted(tiny_model_path, 64)
    gone = weakref.ref(admission)
    del admission
    gc.collect()
    assert gone() is None  # no cache shared between instances keeps it alive


def test_admission_keeps_the_skeleton_not_the_weights(tiny_model_path):
    import onnx

    from server.memory.device import PlanMemory

    model = onnx.load(tiny_model_path)
    heaviest = max(np.prod(init.dims) for init in model.graph.initializer)
    admission = PlanMemory(model, budget_bytes=None)
    kept = [init for init in admission.model.model.graph.initializer if np.prod(init.dims) == heaviest]
    assert heaviest > 64 and not kept  # the 10x3x32x32 conv weights are not held a second time
    assert admission.predicted_bytes(96, 64) == profile_model(model, height=96, width=64).predicted_peak_bytes


# --- plans: one budget for every model's plans ------------------------------------------------

def plan_admissions(tiny_model_path, coordinate_model_path, *, total_bytes, device=None):
    import onnx

    from convert.memory_model import Device
    from server.memory.device import PlanMemory
    from server.memory.device import MemoryBudget

    device = device or Device.CPU
    budget = MemoryBudget(total_bytes, device=device)
    tiny = PlanMemory(onnx.load(tiny_model_path), name="tiny", shared=budget, device=device)
    coords = PlanMemory(onnx.load(coordinate_model_path), name="coords", shared=budget, device=device)
    return budget, tiny, coords


def test_plans_of_every_model_share_one_budget_and_the_least_recently_used_go(tiny_model_path, coordinate_model_path):
    """On CUDA, where each plan keeps all it holds (its weights and its arena): plans of the same size cost the same."""
    from convert.memory_model import Device
    from convert.profile import profile_model

    one = profile_model(tiny_model_path, height=256, width=256, device=Device.CUDA).predicted_peak_bytes
    budget, tiny, coords = plan_admissions(tiny_model_path, coordinate_model_path, total_bytes=int(2.5 * one),
                                           device=Device.CUDA)
    evicted_elsewhere = []
    coords.on_evict = evicted_elsewhere.append
    assert tiny.make_room("a", height=256, width=256, batch=1) == []
    assert coords.make_room("b", height=256, width=256, batch=1) == []
    tiny.plan_used("a")  # "b" is now the least recently used
    assert tiny.make_room("c", height=256, width=256, batch=1) == []
    assert evicted_elsewhere == ["b"]  # another model's plan, handed to its cache
    assert [record.key for record in budget.plans()] == ["a", "c"]
    assert tiny.make_room("d", height=256, width=256, batch=1) == ["a"]  # this model's own, for the caller to drop
    assert budget.used_bytes() <= budget.total_bytes
    tiny.plan_evicted("c")
    assert [record.key for record in budget.plans()] == ["d"]


def test_cpu_plans_of_a_model_hold_its_weights_once_and_its_largest_running_batch(tiny_model_path,
                                                                                coordinate_model_path):
    """On the CPU a model's plans share its weights and one arena: a further plan costs its own state,
    a larger one the growth of the largest running batch; another model's plans hold their own weights and batch."""
    from server.memory.device import held_bytes

    budget, tiny, coords = plan_admissions(tiny_model_path, coordinate_model_path, total_bytes=None)
    small, large = tiny.terms(256, 256, 1), tiny.terms(512, 512, 1)
    assert small.per_model == small.weights > 0 and small.per_run > 0
    assert small.per_model + small.per_plan + small.per_run == small.total
    tiny.make_room("a", height=256, width=256, batch=1)
    assert budget.used_bytes() == small.total
    tiny.make_room("b", height=256, width=256, batch=1)
    assert budget.used_bytes() == small.total + small.per_plan
    tiny.make_room("c", height=512, width=512, batch=1)
    assert budget.used_bytes() == large.total + 2 * small.per_plan
    coords.make_room("d", height=256, width=256, batch=1)
    other = coords.terms(256, 256, 1)
    assert budget.used_bytes() == large.total + 2 * small.per_plan + other.total
    assert held_bytes(budget.plans()) == budget.used_bytes()
    # Measured on the CPU: what the plan holds alone, and of it its running batch's.
    tiny.plan_created("c", large.per_model + 3 * 2**20 + large.per_run // 2, run_bytes=large.per_run // 2)
    record = budget.record(tiny, "c")
    assert record.own_bytes == 3 * 2**20 and record.run_bytes == large.per_run // 2
    assert budget.used_bytes() == small.per_model + 2 * small.per_plan + 3 * 2**20 + max(small.per_run, large.per_run // 2) + other.total
    tiny.plan_evicted("c")
    assert budget.used_bytes() == small.total + small.per_plan + other.total


def test_a_model_with_two_runners_holds_its_largest_running_batch_twice(tiny_model_path):
    """--cpu-runners 2: two of a model's batches run at once, each taking its block from the arena, and both may be
    of its largest plan; one batch of each of two plans must fit the model's budget with a second one running."""
    import onnx

    from server.memory.device import MemoryBudget, PlanMemory, held_bytes

    budget = MemoryBudget(None, device=Device.CPU)
    tiny = PlanMemory(onnx.load(tiny_model_path), name="tiny", shared=budget, runners=2)
    small, large = tiny.terms(256, 256, 1), tiny.terms(512, 512, 1)
    tiny.make_room("small", height=256, width=256, batch=1)
    assert budget.used_bytes() == small.total + small.per_run  # a single plan, run twice at once
    tiny.make_room("large", height=512, width=512, batch=1)
    two_running = small.per_model + small.per_plan + large.per_plan + 2 * large.per_run
    assert budget.used_bytes() == held_bytes(budget.plans()) == two_running
    tiny.runners = 1
    assert budget.used_bytes() == two_running - large.per_run
    # the batch limit: a batch fits when two of it running at once do
    one_runner = PlanMemory(onnx.load(tiny_model_path), budget_bytes=large.total + large.per_run // 2)
    two_runners = PlanMemory(onnx.load(tiny_model_path), budget_bytes=large.total + large.per_run // 2, runners=2)
    assert one_runner.fitting_batch(512, 512) >= 1 and two_runners.fitting_batch(512, 512) == 0
    with pytest.raises(ScoringError, match=r"2 batches of it running at once \(--cpu-runners\)"):
        two_runners.require_batch(512, 512, scale=512, largest_scale=lambda: 0)
    # a plan that fits with one run but not with two is refused, not let in over the budget
    tight = MemoryBudget(large.total + large.per_run // 2, device=Device.CPU)
    two = PlanMemory(onnx.load(tiny_model_path), name="two", shared=tight, runners=2)
    with pytest.raises(ScoringError, match="memory budget"):
        two.make_room("large", height=512, width=512, batch=1)
    assert tight.used_bytes() == 0


def test_a_budget_evicts_until_the_plans_held_together_fit(tiny_model_path, coordinate_model_path):
    """Eviction counts what the plans hold together: dropping a model's smaller plan frees only its own state."""
    from convert.memory_model import Device

    small = profile_model(tiny_model_path, height=256, width=256, device=Device.CPU).terms
    large = profile_model(tiny_model_path, height=512, width=512, device=Device.CPU).terms
    budget, tiny, _coords = plan_admissions(tiny_model_path, coordinate_model_path,
                                            total_bytes=large.total + small.per_plan)
    assert tiny.make_room("a", height=256, width=256, batch=1) == []
    assert tiny.make_room("b", height=256, width=256, batch=1) == []
    assert tiny.make_room("c", height=512, width=512, batch=1) == ["a"]  # b's state and c's batch still fit
    assert [record.key for record in budget.plans()] == ["b", "c"]
    assert budget.used_bytes() <= budget.total_bytes


def test_a_plan_that_cannot_fit_alone_is_refused_with_the_numbers(tiny_model_path, coordinate_model_path):

    from server.errors import ScoringError

    budget, tiny, _coords = plan_admissions(tiny_model_path, coordinate_model_path, total_bytes=predicted(tiny_model_path, 256))
    tiny.make_room("small", height=128, width=128, batch=1)
    with pytest.raises(ScoringError) as caught:
        tiny.make_room("big", height=512, width=512, batch=1, scale=512, largest_scale=lambda: 256)
    assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED
    needed = predicted(tiny_model_path, 512)
    assert f"plan big for scale 512 needs a predicted {needed} bytes" in caught.value.message
    assert f"the memory budget is {budget.total_bytes} bytes" in caught.value.message
    assert "the largest scale that fits is 256" in caught.value.message
    assert [record.key for record in budget.plans()] == ["small"]  # nothing evicted for a refusal


def test_a_measured_plan_is_accounted_at_its_measurement_and_a_bad_prediction_is_logged(
        tiny_model_path, coordinate_model_path, caplog):
    from server.metrics import Metrics

    budget, tiny, _coords = plan_admissions(tiny_model_path, coordinate_model_path, total_bytes=None)
    tiny.metrics = Metrics()
    terms = tiny.terms(256, 256, 1)
    tiny.make_room("a", height=256, width=256, batch=1)
    assert budget.used_bytes() == terms.total
    with caplog.at_level("WARNING", logger="server.memory.device"):
        tiny.plan_created("a", 10 * terms.resident)
    assert "plan a measured" in caplog.text and "(10.00x)" in caplog.text
    # On the CPU the run's activations come back after each run: the measurement plus them.
    assert budget.used_bytes() == 10 * terms.resident + terms.transient
    registry = tiny.metrics.registry
    assert registry.get_sample_value("scoremap_plan_bytes", {"model": "tiny", "plan": "a", "kind": "measured"}) == 10 * terms.resident
    tiny.plan_evicted("a")
    assert registry.get_sample_value("scoremap_plan_bytes", {"model": "tiny", "plan": "a", "kind": "measured"}) is None
    # Made again later, the plan is reserved at what it measured, not at the prediction.
    tiny.make_room("a", height=256, width=256, batch=1)
    assert budget.used_bytes() == 10 * terms.resident + terms.transient


def test_a_reading_below_the_weights_keeps_the_prediction(tiny_model_path, coordinate_model_path):
    """A session holds at least its weights: a smaller reading means memory was freed elsewhere while the
    plan was made (bench_server read 0 B for a 115 MiB plan), and accounting it would overcommit the budget."""
    budget, tiny, _coords = plan_admissions(tiny_model_path, coordinate_model_path, total_bytes=None)
    terms = tiny.terms(256, 256, 1)
    assert terms.weights > 0
    tiny.make_room("a", height=256, width=256, batch=1)
    tiny.plan_created("a", terms.weights - 1)
    assert budget.used_bytes() == terms.total
    tiny.plan_evicted("a")
    tiny.make_room("a", height=256, width=256, batch=1)  # made again: still the prediction, not the reading
    assert budget.used_bytes() == terms.total


def test_admission_predicts_for_the_device_the_model_runs_on(tiny_model_path):
    import onnx

    from convert.memory_model import Device
    from server.memory.device import PlanMemory

    graph = onnx.load(tiny_model_path)
    cpu, cuda = PlanMemory(graph, device=Device.CPU), PlanMemory(graph, device=Device.CUDA)
    assert cpu.predicted_bytes(256, 256) == predicted(tiny_model_path, 256)
    assert cuda.predicted_bytes(256, 256) == profile_model(graph, height=256, width=256, device=Device.CUDA).predicted_peak_bytes
    assert cuda.predicted_bytes(256, 256) > cpu.predicted_bytes(256, 256) + 100 * 2**20  # session state + workspace


# --- host memory ------------------------------------------------------------------------------

def test_by_default_no_size_cap_the_request_s_own_estimate_decides():
    """No --max-scale or --max-resized-pixels by default: a cap derived from the worst request the limits allow
    (11.8 Mpx) would refuse a 12 Mpx phone photo at its own size that needs a fraction of the 4 GiB limit."""
    from server.memory.host import TiledScale, estimate_request
    from server.settings import Settings

    settings = Settings()
    assert settings.max_scale is None and settings.max_resized_pixels is None
    photo = estimate_request(encoded_bytes=4 << 20, image_size=(3008, 4000), resized_sizes=[], passes=1, flip=False,
                             classes=1000, native_stride=32, output_stride=32,
                             tiled=[TiledScale((3008, 4000), (2048, 2048), 12, 58 * 58)])
    assert photo.total < settings.max_request_host_bytes / 4, photo.describe()  # 0.8 GiB with 1000-class maps
    no_maps = estimate_request(encoded_bytes=4 << 20, image_size=(3008, 4000), resized_sizes=[], passes=1, flip=False,
                               classes=1000, native_stride=32, output_stride=32, lattice_itemsize=0,
                               tiled=[TiledScale((3008, 4000), (2048, 2048), 12, 58 * 58)])
    assert no_maps.maps == 0 and no_maps.total < photo.total  # top-k only: no lattice comes back


def test_a_request_too_large_for_host_memory_is_refused_before_decoding():
    import io

    from PIL import Image

    from server.memory.host_budget import admit_host
    from server.errors import ScoringError
    from server.memory.host import HOST_PASSES, estimate_request

    buffer = io.BytesIO()
    Image.new("RGB", (4000, 3000)).save(buffer, format="PNG")
    sizes = [(1536, 2048), (2304, 3072)]
    estimate = estimate_request(encoded_bytes=len(buffer.getvalue()), image_size=(3000, 4000), resized_sizes=sizes,
                                passes=4, flip=True, classes=1000, native_stride=32, output_stride=16,
                                path=HOST_PASSES)
    inputs = sum(h * w for h, w in sizes) * 3 * 4 * 8 * 2  # float32 RGB, 4 passes x 2 orientations, each stacked
    assert estimate.inputs == inputs and estimate.decoded == 3000 * 4000 * 7
    with pytest.raises(ScoringError) as caught:
        admit_host(estimate, limit_bytes=inputs)
    assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED
    assert f"needs an estimated {estimate.total} bytes of host memory" in caught.value.message
    assert f"inputs {inputs / 2**20:,.0f} MiB" in caught.value.message
    admit_host(estimate, limit_bytes=estimate.total)


# --- NHWC (Keras-style) models ----------------------------------------------------------------

def nhwc_patch_net(classes: int = 10):
    """tests.tiny_models.patch_net with a channels-last input and a Transpose in front, as tf2onnx writes."""
    import onnx
    from onnx import TensorProto, helper

    from convert.card import Layout, read_card, write_card
    from tests.tiny_models import patch_net

    model = patch_net(classes=classes)
    graph = model.graph
    graph.node.insert(0, helper.make_node("Transpose", ["image"], ["image_nchw"], perm=[0, 3, 1, 2]))
    graph.node[1].input[0] = "image_nchw"
    del graph.input[:]
    graph.input.append(helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", "H", "W", 3]))
    card = read_card(model)
    card.preprocessing.layout = Layout.LAYOUT_NHWC
    onnx.checker.check_model(write_card(model, card))
    return model


def test_an_nhwc_model_is_admitted_and_scored_like_its_nchw_twin(kit, tmp_path, tiny_model_path):
    import onnx

    from server.memory.device import PlanMemory

    path = tmp_path / "tiny_nhwc.onnx"
    onnx.save(nhwc_patch_net(), path)
    nhwc = PlanMemory(onnx.load(path), budget_bytes=None)
    # The same net plus the Transpose's NCHW copy of the input.
    assert nhwc.predicted_bytes(96, 64) > PlanMemory(onnx.load(tiny_model_path)).predicted_bytes(96, 64)
    pixels = np.random.default_rng(0).integers(0, 255, (96, 64, 3), dtype=np.uint8)
    request = kit.raw_request(pixels, scales=[64], return_maps=True, output_stride=16)
    with kit.serving([str(path)]) as (_server, _port, stub):
        answer = stub.Score(request, timeout=30)
    with kit.serving([tiny_model_path]) as (_server, _port, stub):
        twin = stub.Score(request, timeout=30)
    np.testing.assert_allclose(kit.decode_tensor(answer.maps[0].scores), kit.decode_tensor(twin.maps[0].scores),
                               rtol=1e-5, atol=1e-5)


def test_the_converted_tf2onnx_graph_is_admitted_and_scored(kit, tmp_path):
    import onnx

    from convert import convert_classifier
    from server.memory.device import PlanMemory
    from tests.convert.test_onnx_families import UNIT_RANGE, tf2onnx_classifier

    path = tmp_path / "keras.onnx"
    onnx.save(convert_classifier(tf2onnx_classifier(), preprocessing=UNIT_RANGE, name="keras"), path)
    assert PlanMemory(onnx.load(path)).predicted_bytes(40, 36, 2) > 0
    pixels = np.random.default_rng(1).integers(0, 255, (40, 36, 3), dtype=np.uint8)
    with kit.serving([str(path)], warm_up=True) as (_server, _port, stub):
        answer = stub.Score(kit.raw_request(pixels, scales=[36], return_maps=True, top_k=3), timeout=30)
    assert answer.maps and len(answer.top_k) == 3
    assert kit.decode_tensor(answer.maps[0].scores).shape[0] == 3


def test_requests_in_flight_share_the_host_budget():

    from server.memory.host_budget import HostBudget
    from server.errors import ScoringError
    from server.memory.host import HostEstimate

    request = HostEstimate(encoded=10, decoded=20, resized=30, inputs=40, maps=0)  # 100 bytes
    budget = HostBudget(250)
    with budget.hold(request), budget.hold(request):
        assert budget.in_flight_bytes() == 200
        with pytest.raises(ScoringError) as caught:
            with budget.hold(request):
                pass
        assert caught.value.refusal is Refusal.RESOURCE_EXHAUSTED
        assert caught.value.retry_after_seconds is not None  # transient: the others will finish
        assert "requests in flight hold 200 of the server's 250 bytes" in caught.value.message
    assert budget.in_flight_bytes() == 0
    with pytest.raises(ScoringError) as caught:
        with HostBudget(50).hold(request):
            pass
    assert caught.value.retry_after_seconds is None and "does not fit even alone" in caught.value.message


def test_the_host_budget_defaults_to_a_share_of_available_memory_and_holds_one_largest_request():
    import dataclasses

    from server.memory.host_budget import HostBudget, available_memory_bytes
    from server.settings import Settings

    settings = Settings()
    def sized(settings: Settings) -> HostBudget:
        return HostBudget.sized(settings.host_memory_budget_bytes, fraction=settings.host_memory_fraction,
                                at_least=settings.max_request_host_bytes)

    total = sized(settings).total_bytes
    assert total >= settings.max_request_host_bytes
    assert total >= int(available_memory_bytes() * settings.host_memory_fraction) * 0.9
    assert sized(dataclasses.replace(settings, host_memory_budget_bytes=123)).total_bytes == 123
