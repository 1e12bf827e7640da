"""What one onnxruntime session needs on a device, term by term, from the graph's profile.

    predicted = weights + weight copies + session state + run workspace + activation factor x live peak

`weights` and `live peak` come from the graph (convert.profile); the other terms are properties of
the execution provider, each fitted on measurements of that provider and kept here with the
numbers it was fitted on:

* CPU (onnxruntime 1.31, CPU provider, `server.memory.runtime.predictable_session_options`:
  onnxruntime's own defaults, its memory pattern on, one arena for the whole process
  (server.memory.arena); each plan's graph optimized once and loaded on its model's one copy of the
  optimized weights (server.engine.shared_weights); the allocator as `configure_allocator` sets it; the
  first run through `first_cpu_run`, as server/engine/providers.py makes every plan): a plan alone
  holds, from its second run on, weights + 1.1 x live peak + ~2 MiB, and no run after it takes more
  (CPU_MEASUREMENTS, measured in the server's own process with an arena per plan). The 1.1 is the memory
  pattern's block (onnxruntime's planner places buffers by first fit, so the block exceeds the live peak)
  and the run's outputs; the ~2 MiB the session's own state and
  run workspace. Least squares over CPU_MEASUREMENTS gave 1.106 and 1.3 MiB; rounded, every case is
  within 5%. A server's first plan costs ~7 MiB more, once (the interpreter's and onnxruntime's
  first-use state), and making a plan peaks transiently above what it keeps (the plan graph built and
  optimized, the session loaded: bench_cpu_plans).

  Several plans of one model share (CPU_SHARED_MEASUREMENTS, the default warm-up's ten
  plans measured by the server itself): the weights are held once per model (`per_model`; as
  optimized they are the same bytes, 17.73 MiB against 17.70), each plan keeps 0.9-1.7 MiB of its
  own between runs (`per_plan`: the session state term), and a running batch takes 1.07-1.08 x live
  peak from the shared arena and hands it back (`per_run`: workspace + activations), of which the
  arena keeps the largest.
* CUDA (H100, onnxruntime-gpu 1.31.1, `arena_extend_strategy=kSameAsRequested`): device memory
  over the process's baseline, `CUDA_MEASUREMENTS` below. Creating a session costs the weights
  plus ~76 MiB of CUDA/cuDNN/cuBLAS handles and streams (94 MiB on EfficientNet-Lite0, whose
  weights are 17.7 MiB); the first runs add a constant ~66 MiB (cuBLAS/cuDNN workspaces), about
  0.8x the weights again (weights re-laid out for cuDNN's kernels: +524 MiB on VGG16 at 224 px,
  whose weights are 528 MiB) and 2x the live activations (the arena keeps what it grew to and
  the kernels' scratch is sized like their outputs). Least squares over the 9 measurements gave
  copies 0.78, workspace 66.1 MiB, factor 2.01 with the session state held at its measured
  76 MiB; rounded, every case is within 1% (tests/convert/test_memory_model.py holds it to 25%).
  `cudnn_conv_use_max_workspace=0` changed nothing.

A server with several plans per model (one session per shape) pays, on CUDA, everything once per
plan; on the CPU the weights once per model, the session state once per plan and the largest running
batch once (`per_model`, `per_plan`, `per_run`; server/memory/device.py accounts them and measures
plans instead once they exist).
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["Device", "ProviderTerms", "MemoryTerms", "PROVIDER_TERMS", "CPU_MEASUREMENTS", "CPU_SHARED_MEASUREMENTS",
           "CUDA_MEASUREMENTS", "predict"]

MiB = 2**20


class Device(enum.Enum):
    """Where a session's memory lives: host RAM (CPU provider) or GPU memory (CUDA provider)."""

    CPU = "cpu"
    CUDA = "cuda"


@dataclasses.dataclass(frozen=True)
class ProviderTerms:
    """The fitted, provider-specific part of the model."""

    weight_copies: float      # extra copies of the weights the provider keeps, as a fraction of them
    session_bytes: int        # per-session state (handles, streams, kernel registries)
    workspace_bytes: int      # per-run constant workspace
    activation_factor: float  # bytes held per byte of the graph's live activation peak
    keeps_run_memory: bool    # the provider's arena keeps what a run grew it to (else freed after the run)
    fitted_on: str
    # A server's plans of one model (sessions of one shape each) share the model's weights: held once per model.
    weights_shared: bool = False
    # Every plan's runs take their activations from one arena (server.memory.arena) and hand them back: a plan
    # keeps none between runs, the arena the largest block a running batch took.
    arena_shared: bool = False


PROVIDER_TERMS = {
    Device.CPU: ProviderTerms(
        weight_copies=0.0, session_bytes=1 * MiB, workspace_bytes=1 * MiB, activation_factor=1.1, keeps_run_memory=True,
        weights_shared=True, arena_shared=True,
        fitted_on="resident set a plan's session keeps after its warm-up runs, onnxruntime 1.31 CPU provider with its "
                  "arena and memory pattern, the default model, a VGG-width net and the same net taking NHWC, "
                  "224-512 px, batch 1 and 4, RSS growth of a scoremap-serve process at each plan's first request "
                  "(CPU_MEASUREMENTS, bench_cpu_plans); split per model, plan and running batch on the default "
                  "warm-up's ten plans sharing the weights and one arena (CPU_SHARED_MEASUREMENTS)",
    ),
    Device.CUDA: ProviderTerms(
        weight_copies=0.8, session_bytes=76 * MiB, workspace_bytes=66 * MiB, activation_factor=2.0, keeps_run_memory=True,
        fitted_on="cudaMemGetInfo, H100, onnxruntime-gpu 1.31.1 CUDA provider, EfficientNet-Lite0 dense and VGG16 "
                  "dense, 224-1024 px, batch 1-8 (CUDA_MEASUREMENTS)",
    ),
}

# The CPU measurements the terms were fitted on (bench_cpu_plans on a 2-core AMD EPYC shared with
# other work, onnxruntime 1.31.1): model, side, batch, passes, weights MiB, live activation peak MiB
# (convert.profile of the net at side x side, batch x passes), VmRSS growth of the scoremap-serve
# process at the plan's first request(s) MiB (a plan made after the server's first).
CPU_MEASUREMENTS = (
    ("efficientnet-lite0 dense", 224, 1, 1, 17.7, 6.3, 26.8),
    ("efficientnet-lite0 dense", 384, 1, 1, 17.7, 18.6, 40.6),
    ("efficientnet-lite0 dense", 512, 1, 1, 17.7, 33.0, 56.2),
    ("efficientnet-lite0 dense", 224, 4, 1, 17.7, 25.3, 47.0),
    ("efficientnet-lite0 dense", 384, 4, 1, 17.7, 74.2, 101.6),
    ("efficientnet-lite0 dense", 512, 4, 1, 17.7, 132.0, 166.8),
    ("VGG-width dense", 224, 1, 1, 16.0, 6.7, 24.7),
    ("VGG-width dense", 384, 1, 1, 16.0, 19.7, 38.3),
    ("VGG-width dense", 512, 1, 1, 16.0, 35.0, 54.7),
    ("VGG-width dense", 224, 4, 1, 16.0, 26.8, 45.7),
    ("VGG-width dense", 384, 4, 1, 16.0, 78.8, 100.7),
    ("VGG-width dense", 512, 4, 1, 16.0, 140.0, 167.6),
    ("VGG-width NHWC dense", 224, 1, 1, 16.0, 6.7, 25.1),
    ("VGG-width NHWC dense", 384, 1, 1, 16.0, 19.7, 39.0),
    ("VGG-width NHWC dense", 512, 1, 1, 16.0, 35.0, 56.9),
    ("VGG-width NHWC dense", 224, 4, 1, 16.0, 26.8, 47.4),
    ("VGG-width NHWC dense", 384, 4, 1, 16.0, 78.8, 105.9),
    ("VGG-width NHWC dense", 512, 4, 1, 16.0, 140.0, 176.3),
)

# The CPU plans of one server sharing their model's weights and one arena (the default model's warm-up,
# scoremap-serve's own measurement of each plan as it was made, onnxruntime 1.31.1, 2-core AMD EPYC): model, canvas
# height, width, batch, passes, live activation peak MiB (convert.profile of the net at the canvas, batch x
# passes), what the plan keeps of its own between runs MiB (RSS growth at its session's creation and first run,
# the model's new shared weights taken out), what its run took from the emptied arena MiB.
CPU_SHARED_MEASUREMENTS = (
    ("efficientnet-lite0 dense", 384, 384, 1, 1, 18.6, 1.7, 19.8),
    ("efficientnet-lite0 dense", 384, 512, 1, 1, 24.8, 0.9, 26.4),
    ("efficientnet-lite0 dense", 512, 384, 1, 1, 24.8, 0.9, 26.7),
    ("efficientnet-lite0 dense", 384, 576, 1, 1, 27.8, 0.9, 30.0),
    ("efficientnet-lite0 dense", 576, 384, 1, 1, 27.8, 0.9, 30.0),
    ("efficientnet-lite0 dense", 416, 416, 1, 4, 87.1, 1.1, 93.8),
    ("efficientnet-lite0 dense", 416, 544, 1, 4, 114.0, 1.3, 122.9),
    ("efficientnet-lite0 dense", 544, 416, 1, 4, 114.0, 0.9, 122.9),
    ("efficientnet-lite0 dense", 416, 608, 1, 4, 127.4, 0.9, 137.5),
    ("efficientnet-lite0 dense", 608, 416, 1, 4, 127.4, 1.0, 137.5),
)

# The CUDA measurements the terms were fitted on: model, side, batch, weights MiB,
# live activation peak MiB (convert.profile at that size), device memory measured MiB.
CUDA_MEASUREMENTS = (
    ("efficientnet-lite0 dense", 224, 1, 17.7, 6.3, 186),
    ("efficientnet-lite0 dense", 384, 1, 17.7, 18.6, 212),
    ("efficientnet-lite0 dense", 384, 8, 17.7, 148.4, 472),
    ("efficientnet-lite0 dense", 1024, 1, 17.7, 132.0, 438),
    ("efficientnet-lite0 dense", 1024, 4, 17.7, 528.0, 1242),
    ("VGG16 dense", 224, 1, 527.8, 25.1, 1138),
    ("VGG16 dense", 384, 1, 527.8, 73.7, 1232),
    ("VGG16 dense", 384, 4, 527.8, 294.8, 1672),
    ("VGG16 dense", 768, 1, 527.8, 294.8, 1676),
)


@dataclasses.dataclass(frozen=True)
class MemoryTerms:
    """The prediction for one session and input shape, every term in bytes."""

    device: Device
    weights: int
    weight_copies: int
    session_state: int
    run_workspace: int
    live_peak: int
    activations: int  # activation_factor x live_peak

    @property
    def total(self) -> int:
        return self.weights + self.weight_copies + self.session_state + self.run_workspace + self.activations

    @property
    def fixed(self) -> int:
        """What does not grow with the input: everything but the activations."""
        return self.total - self.activations

    @property
    def transient(self) -> int:
        """What a run needs and gives back when it returns: nothing on either provider (the CPU's
        and CUDA's arenas keep what the first runs grew them to); kept for a provider that frees."""
        if PROVIDER_TERMS[self.device].keeps_run_memory:
            return 0
        return self.run_workspace + self.activations

    @property
    def resident(self) -> int:
        """What the session holds between runs once warmed up: what a footprint measures."""
        return self.total - self.transient

    # --- what a server's plans (sessions of one model, one shape each) hold together ----------------------
    @property
    def per_model(self) -> int:
        """Held once per model however many plans it has: its weights, where its plans share them."""
        return self.weights + self.weight_copies if PROVIDER_TERMS[self.device].weights_shared else 0

    @property
    def per_run(self) -> int:
        """Held by a running batch, where runs take it from the one arena and hand it back: of a model's plans, the
        arena holds the largest; 0 where each plan keeps its own (it is then part of `per_plan`)."""
        return self.run_workspace + self.activations if PROVIDER_TERMS[self.device].arena_shared else 0

    def running(self, runs: int) -> int:
        """The whole, with `runs` batches of this shape running at once (a server's --cpu-runners): each takes its
        own `per_run` from the arena."""
        return self.total + (runs - 1) * self.per_run

    @property
    def per_plan(self) -> int:
        """What each plan keeps between runs beyond its model's and its running batch's: its session state, and
        whatever it does not share."""
        return self.total - self.per_model - self.per_run

    def rows(self) -> list[tuple[str, int, str]]:
        """(term, bytes, how it is computed), in the order of the formula."""
        terms = PROVIDER_TERMS[self.device]
        return [
            ("weights", self.weights, "every initializer, at its dtype" + (", once per model" if terms.weights_shared else "")),
            ("weight copies", self.weight_copies, f"{terms.weight_copies:g} x weights"),
            ("session state", self.session_state, "per session, with the int8 weights its kernels pack"),
            ("run workspace", self.run_workspace, "per run, constant" + (", shared arena" if terms.arena_shared else "")),
            ("activations", self.activations, f"{terms.activation_factor:g} x live peak"
             + (", shared arena: held while the batch runs" if terms.arena_shared else "")),
        ]

    def to_dict(self) -> dict:
        return {"device": self.device.value, **{name.replace(" ", "_"): value for name, value, _ in self.rows()},
                "live_peak": self.live_peak, "total": self.total, "per_model": self.per_model,
                "per_plan": self.per_plan, "per_run": self.per_run,
                "fitted_on": PROVIDER_TERMS[self.device].fitted_on}


def predict(device: Device, *, weights_bytes: int, peak_activation_bytes: int, packed_bytes: int = 0) -> MemoryTerms:
    """Every term of one session's memory on `device` for a graph with these weights and live peak; `packed_bytes`:
    the int8 weights its integer kernels pack, which each session keeps a copy of (onnxruntime shares initializers
    between sessions, not what a kernel packs from them: the default model's int8 plans each held 5-6 MiB beyond
    the session state, its int8 weights being 4.5 MiB)."""
    terms = PROVIDER_TERMS[device]
    return MemoryTerms(
        device=device,
        weights=weights_bytes,
        weight_copies=int(terms.weight_copies * weights_bytes),
        session_state=terms.session_bytes + packed_bytes,
        run_workspace=terms.workspace_bytes,
        live_peak=peak_activation_bytes,
        activations=int(terms.activation_factor * peak_activation_bytes),
    )
