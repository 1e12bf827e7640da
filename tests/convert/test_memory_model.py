"""The per-provider memory model against the measurements it was fitted on."""

import pytest

from convert.card import Layout
from convert.memory_model import (CPU_MEASUREMENTS, CPU_SHARED_MEASUREMENTS, CUDA_MEASUREMENTS, PROVIDER_TERMS, Device,
                                 MiB, predict)
from convert.profile import load_skeleton, profile_model
from tests.convert.test_profile import vgg_graph

BOUND = 0.25  # the acceptance bound on predicted / measured


@pytest.mark.parametrize("model, side, batch, weights_mib, peak_mib, measured_mib", CUDA_MEASUREMENTS)
def test_cuda_terms_predict_the_recorded_h100_measurements(model, side, batch, weights_mib, peak_mib, measured_mib):
    terms = predict(Device.CUDA, weights_bytes=int(weights_mib * MiB), peak_activation_bytes=int(peak_mib * MiB))
    assert abs(terms.total / (measured_mib * MiB) - 1) <= BOUND, terms
    assert terms.total == sum(value for _, value, _ in terms.rows())


@pytest.fixture(scope="module")
def profiles(default_model_path):
    """The real graphs' profiles at the measured shapes: the table's weights and live peaks are theirs."""
    vgg = load_skeleton(vgg_graph(dense=True), layout=Layout.LAYOUT_NCHW)
    paths = {"efficientnet-lite0 dense": default_model_path, "VGG16 dense": vgg}
    return {(model, side, batch): profile_model(paths[model], height=side, width=side, batch=batch, device=Device.CUDA)
            for model, side, batch, *_ in CUDA_MEASUREMENTS}


def test_the_recorded_inputs_are_the_profiles_of_the_measured_graphs(profiles):
    for model, side, batch, weights_mib, peak_mib, measured_mib in CUDA_MEASUREMENTS:
        profile = profiles[(model, side, batch)]
        assert profile.weights_bytes / MiB == pytest.approx(weights_mib, abs=0.1)
        assert profile.peak_activation_bytes / MiB == pytest.approx(peak_mib, rel=0.02)
        assert abs(profile.predicted_peak_bytes / (measured_mib * MiB) - 1) <= BOUND, (model, side, batch)


@pytest.mark.parametrize("model, side, batch, passes, weights_mib, peak_mib, measured_mib", CPU_MEASUREMENTS)
def test_cpu_terms_predict_the_recorded_plan_measurements(model, side, batch, passes, weights_mib, peak_mib,
                                                          measured_mib):
    """weights + 1.1 x live peak + 2 MiB: within 6% of what each plan kept in a server process."""
    terms = predict(Device.CPU, weights_bytes=int(weights_mib * MiB), peak_activation_bytes=int(peak_mib * MiB))
    assert abs(terms.total / (measured_mib * MiB) - 1) <= 0.06, terms
    assert terms.resident == terms.total  # the arena keeps what the runs take: nothing is given back


def test_the_recorded_cpu_inputs_are_the_profiles_of_the_measured_graphs(default_model_path, tmp_path):
    from bench.cpu_models import converted

    paths = {"efficientnet-lite0 dense": default_model_path, "VGG-width dense": converted(tmp_path, "vgg"),
             "VGG-width NHWC dense": converted(tmp_path, "nhwc")}
    for model, side, batch, passes, weights_mib, peak_mib, _ in CPU_MEASUREMENTS:
        profile = profile_model(paths[model], height=side, width=side, batch=batch * passes)
        assert profile.weights_bytes / MiB == pytest.approx(weights_mib, abs=0.1), model
        assert profile.peak_activation_bytes / MiB == pytest.approx(peak_mib, rel=0.02), (model, side, batch, passes)


def test_every_provider_says_what_it_was_fitted_on():
    assert set(PROVIDER_TERMS) == set(Device)
    assert all(terms.fitted_on for terms in PROVIDER_TERMS.values())


@pytest.mark.parametrize("model, height, width, batch, passes, peak_mib, own_mib, run_mib", CPU_SHARED_MEASUREMENTS)
def test_cpu_terms_split_what_plans_sharing_a_model_hold(model, height, width, batch, passes, peak_mib, own_mib,
                                                         run_mib):
    """Per plan: its session state (what it keeps of its own between runs); per running batch: workspace and
    activations, which the shared arena hands back."""
    terms = predict(Device.CPU, weights_bytes=int(17.7 * MiB), peak_activation_bytes=int(peak_mib * MiB))
    assert terms.per_model == terms.weights  # once per model
    assert abs(terms.per_plan - own_mib * MiB) <= 1 * MiB, terms
    assert abs(terms.per_run / (run_mib * MiB) - 1) <= 0.1, terms
    assert terms.per_model + terms.per_plan + terms.per_run == terms.total


def test_the_recorded_shared_cpu_inputs_are_the_profiles_of_the_measured_plans(default_model_path):
    for _model, height, width, batch, passes, peak_mib, *_ in CPU_SHARED_MEASUREMENTS:
        profile = profile_model(default_model_path, height=height, width=width, batch=batch * passes)
        assert profile.peak_activation_bytes / MiB == pytest.approx(peak_mib, rel=0.02), (height, width, passes)


def test_cuda_plans_keep_all_they_hold_each():
    terms = predict(Device.CUDA, weights_bytes=100 * MiB, peak_activation_bytes=50 * MiB)
    assert terms.per_model == 0 and terms.per_run == 0 and terms.per_plan == terms.total
