"""Host-side cost of one training step: ampkit's paths against torch.amp, on the CPU.

What a GPU cannot hide: Python work, the ops dispatched per step (each one a kernel launch
of ~5 us on a GPU) and host syncs. Measured per path, in one run:

- *kernel ops / step*: ATen ops that compute or copy (views, aliases and bare
  allocations excluded), counted with a TorchDispatchMode over one step;
- *syncs / step*: reads of a tensor value by the host (``aten._local_scalar_dense``);
- *Python calls / step*: function and builtin calls seen by ``sys.setprofile`` over one
  step: the host's Python work, counted exactly (a busy machine cannot blur it);
- *host us / step*: median CPU time of this thread per step over interleaved rounds
  (torch.amp and each ampkit path take turns, each round starting with another path, so
  drift hits all alike; thread time, not wall time, so waiting for a busy machine's cores
  is not counted), 1 thread, tiny models, so the time is dispatch and Python rather than
  arithmetic; *× torch* is the median of the rounds' paired ratios, with its
  distribution-free 95% interval. On CUDA a host sync (``.item()``: torch.amp's
  GradScaler with a foreach optimizer reads found_inf every step) spin-waits on the CPU
  for the GPU, so thread time then counts GPU time too: it is comparable between paths
  only when both have 0 syncs per step (``host_us_comparable``, "*" in the table). CUDA
  runs also record *wall us / step* (perf_counter, from an idle GPU until the GPU has
  finished the round's steps) and *GPU us / step* (CUDA events around the round's steps);
  the ratio columns stay thread-time ratios;
- *peak B/param*: the most bytes of live tensors during a step (params, grads, masters,
  optimizer state and temporaries), per parameter.

Paths: torch.amp (torch.autocast + torch.amp.GradScaler, the reference), ampkit's
torch-style loop (ampkit.autocast + ampkit.GradScaler), ampkit O1 and O2 through
initialize + scale_loss, with AdamW foreach and fused, bf16.

    PYTHONPATH=src python3 benchmarks/bench_host.py [--rounds 30] [--device cuda] [--json out/bench_host.json]

With --json the file is rewritten after each model/optimizer pair (a pair that raises is
an error entry, and the next one runs); an interrupt (SIGINT/SIGTERM) writes what was
measured and exits 130.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from ampkit._torch_compat import TorchDispatchMode  # noqa: E402

import ampkit  # noqa: E402
from ampkit import _state  # noqa: E402
from ampkit._measure import LiveTensorBytes, median_interval  # noqa: E402
from _incremental import error_fields, free_cuda, interrupted, write_json  # noqa: E402

BF16 = torch.bfloat16
# Where the models run (--device): on a GPU the thread's CPU time is the host's work per
# step (launches, Python, dispatch), with kernels running on the device.
DEVICE = torch.device("cpu")
_NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                "_local_scalar_dense", "detach", "alias", "lift_fresh", "_record_function_enter_new",
                "_record_function_exit"}


# --- the models -----------------------------------------------------------------------------
def mlp() -> tuple[nn.Module, torch.Tensor]:
    """The 10-100-10 MLP of torch's AMP recipe, batch 64."""
    return nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10)), torch.randn(64, 10)


def linears() -> tuple[nn.Module, torch.Tensor]:
    """200 x Linear(64, 64): many small tensors (400 params), batch 64."""
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(200)]), torch.randn(64, 64)


def gpt() -> tuple[nn.Module, torch.Tensor]:
    """ampkit bench's small GPT (d=128, 2 layers, seq 64, LayerNorm, SDPA), batch 16:
    activations weigh as much as the weights, as in real training."""
    from ampkit.bench.workloads import GPT, GPTConfig

    cfg = GPTConfig()
    return GPT(cfg), torch.randint(0, cfg.vocab, (16, cfg.seq))


MODELS = {"mlp": mlp, "200xlinear": linears, "gpt": gpt}


def _on_device(model_fn: Callable[[], tuple[nn.Module, torch.Tensor]]) -> tuple[nn.Module, torch.Tensor]:
    model, x = model_fn()
    return model.to(DEVICE), x.to(DEVICE)


def _sync() -> None:
    """Wait for queued device work, so one path's kernels never run in another's time."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


# --- the paths ------------------------------------------------------------------------------
Step = Callable[[], None]


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, **{kind: True})


def _torch_style(autocast: Any, scaler_cls: Any) -> Callable[[nn.Module, torch.Tensor, str], Step]:
    """torch.amp's loop with the given autocast and GradScaler classes."""
    def build(model: nn.Module, x: torch.Tensor, kind: str) -> Step:
        opt = _optimizer(model, kind)
        scaler = scaler_cls(DEVICE.type)

        def step() -> None:
            opt.zero_grad()
            with autocast(DEVICE.type, dtype=BF16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return step
    return build


def _apex_style(level: str) -> Callable[[nn.Module, torch.Tensor, str], Step]:
    def build(model: nn.Module, x: torch.Tensor, kind: str) -> Step:
        opt = _optimizer(model, kind)
        model, opt = ampkit.initialize(model, opt, opt_level=level, half_dtype=BF16,
                                       loss_scale="dynamic", verbosity=0)
        active = _state.get_active()

        def step() -> None:
            _state.set_active(active)  # each path keeps its own initialize
            opt.zero_grad()
            loss = model(x).float().pow(2).mean()
            with ampkit.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        return step
    return build


PATHS = {"torch.amp": _torch_style(torch.autocast, torch.amp.GradScaler),
         "ampkit torch-style": _torch_style(ampkit.autocast, ampkit.GradScaler),
         "ampkit O1": _apex_style("O1"), "ampkit O2": _apex_style("O2")}


# --- the measures ---------------------------------------------------------------------------
class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.syncs = 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.syncs += 1
        elif not func.is_view and name not in _NOT_KERNELS:
            self.kernels += 1
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_ops(step: Step) -> _Counter:
    """Kernel ops and host syncs of one step (after warm-up steps)."""
    with _Counter() as counter:
        step()
    return counter


def count_python_calls(step: Step) -> int:
    """Python-level calls (functions and builtins) in one step: exact, noise-free host work."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def peak_bytes_per_param(build: Callable[..., Step], model_fn: Callable, kind: str) -> float:
    """Peak bytes of live tensors over building and 2 steps, per parameter."""
    torch.manual_seed(0)
    model, x = _on_device(model_fn)
    n = sum(p.numel() for p in model.parameters())
    with LiveTensorBytes() as live:
        for p in model.parameters():  # the fp32 model the user built
            live.track(p)
        step = build(model, x, kind)
        step()
        step()
    return live.peak / n


def _fresh(build: Callable[..., Step], model_fn: Callable, kind: str) -> Step:
    torch.manual_seed(0)
    model, x = _on_device(model_fn)
    step = build(model, x, kind)
    for _ in range(3):  # warm-up: lazy state (optimizer moments, scaler tensors)
        step()
    return step


def measure(model_name: str, kind: str, rounds: int, steps: int) -> dict[str, dict]:
    model_fn = MODELS[model_name]
    steps_of = {name: _fresh(build, model_fn, kind) for name, build in PATHS.items()}
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    walls: dict[str, list[float]] = {name: [] for name in PATHS}
    gpus: dict[str, list[float]] = {name: [] for name in PATHS}
    cuda = DEVICE.type == "cuda"
    if cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    names = list(steps_of)
    for turn in range(rounds):
        # Each round starts with another path, so no path always runs first (caches, clocks).
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            step = steps_of[name]
            _sync()
            wall = time.perf_counter()
            start = time.thread_time_ns()
            if cuda:
                begin.record()
            for _ in range(steps):
                step()
            times[name].append((time.thread_time_ns() - start) / steps / 1e3)
            if cuda:
                end.record()
                _sync()
                walls[name].append((time.perf_counter() - wall) / steps * 1e6)
                gpus[name].append(begin.elapsed_time(end) / steps * 1e3)
    results = {}
    for name, build in PATHS.items():
        counter = count_ops(steps_of[name])
        results[name] = {"kernel_ops": counter.kernels, "syncs": counter.syncs,
                         "python_calls": count_python_calls(steps_of[name]),
                         "host_us": statistics.median(times[name]),
                         "host_us_method": "time.thread_time_ns (this thread's CPU time)",
                         # A CUDA sync spin-waits: thread time then includes GPU time.
                         "host_us_comparable": not cuda or counter.syncs == 0,
                         "wall_us": statistics.median(walls[name]) if cuda else None,
                         "gpu_us": statistics.median(gpus[name]) if cuda else None,
                         "peak_bytes_per_param": peak_bytes_per_param(build, model_fn, kind),
                         "ops": dict(sorted(counter.names.items()))}
    ref = results["torch.amp"]
    for name, row in results.items():
        row["ops_vs_torch"] = row["kernel_ops"] - ref["kernel_ops"]
        # The median of the rounds' paired ratios: a slow spell of the machine hits both
        # sides of a pair, where a ratio of two medians mixes rounds.
        ratios = [mine / theirs for mine, theirs in zip(times[name], times["torch.amp"])]
        row["time_vs_torch"] = statistics.median(ratios)
        row["time_vs_torch_interval"] = median_interval(ratios)  # 95%, distribution-free
    return results


# --- where an apex-style forward's host time goes --------------------------------------------
class _HookedAutocast:
    """torch.autocast entered by a forward pre-hook and left by an always-called forward
    hook: what a model-level region costs through torch's hook path, apart from ampkit."""

    def __init__(self) -> None:
        self.stack: list[Any] = []

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        region = torch.autocast(DEVICE.type, dtype=BF16)
        region.__enter__()
        self.stack.append(region)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.stack.pop().__exit__(None, None, None)


def forward_cost(rounds: int, forwards: int = 50) -> dict[str, dict]:
    """Host time of one MLP forward and loss (backward untimed), three ways: torch.autocast
    around the call, torch.autocast entered through module hooks (what ampkit's O1 region
    cost before its converted forward replaced them: torch's slow path for a module with
    hooks), and ampkit O1 (its converted forward: region and fp32 output cast). Median
    per round, interleaved rounds."""
    torch.manual_seed(0)
    base, x = _on_device(mlp)
    plain, hooked, amp_model = (copy.deepcopy(base) for _ in range(3))
    region = _HookedAutocast()
    hooked.register_forward_pre_hook(region.enter, with_kwargs=True, prepend=True)
    hooked.register_forward_hook(region.leave, prepend=True, always_call=True)
    opt = torch.optim.AdamW(amp_model.parameters(), lr=1e-3, foreach=True)
    amp_model, opt = ampkit.initialize(amp_model, opt, opt_level="O1", half_dtype=BF16, verbosity=0)

    def around() -> torch.Tensor:
        with torch.autocast(DEVICE.type, dtype=BF16):
            return plain(x).float().pow(2).mean()

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "torch.autocast around the call": around,
        "torch.autocast through hooks": lambda: hooked(x).float().pow(2).mean(),
        "ampkit O1 (its forward, fp32 output)": lambda: amp_model(x).float().pow(2).mean()}
    per_round: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for turn in range(rounds):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            times = []
            _sync()
            for _ in range(forwards):
                start = time.thread_time_ns()
                loss = variants[name]()
                times.append(time.thread_time_ns() - start)
                loss.backward()
            per_round[name].append(statistics.median(times) / 1e3)
    ref = per_round[names[0]]
    out = {}
    for name in names:
        ratios = [mine / theirs for mine, theirs in zip(per_round[name], ref)]
        out[name] = {"forward_us": statistics.median(per_round[name]),
                     "extra_us": statistics.median(m - t for m, t in zip(per_round[name], ref)),
                     "time_vs_torch": statistics.median(ratios),
                     "time_vs_torch_interval": median_interval(ratios)}
    return out


def _ratio(row: dict) -> str:
    low, high = row["time_vs_torch_interval"] or (float("nan"), float("nan"))
    return f"{row['time_vs_torch']:.3f} [{low:.3f}, {high:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--optimizers", default="foreach,fused")
    parser.add_argument("--forward", action=argparse.BooleanOptionalAction, default=True,
                        help="also time an apex-style forward's parts (torch's hook path)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (host cost of a GPU step)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(1)
    report = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "device": str(DEVICE),
              "threads": torch.get_num_threads(), "results": {}}
    cuda = DEVICE.type == "cuda"
    if cuda:
        report["host_us_note"] = ("host_us is this thread's CPU time; a CUDA host sync "
                                  "spin-waits, so it counts GPU time for paths with syncs > 0: "
                                  "compare host_us only where host_us_comparable (0 syncs); "
                                  "wall_us and gpu_us are perf_counter and CUDA-event times")
    print(f"torch {torch.__version__}, {DEVICE}, {torch.get_num_threads()} thread, bf16, "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    print(f"{'model':11} {'optim':7} {'path':19} {'ops':>5} {'Δops':>5} {'syncs':>5} "
          f"{'py calls':>8} {'host us':>8} {'× torch [95% interval]':>22} {'B/param':>7}"
          + (f" {'wall us':>8} {'GPU us':>8}" if cuda else ""), flush=True)

    def save() -> None:
        report["interrupted"] = True
        write_json(args.json, report, indent=1)

    with interrupted(save, "bench_host"):
        for model_name in args.models.split(","):
            for kind in args.optimizers.split(","):
                key = f"{model_name}/{kind}"
                try:
                    results = measure(model_name, kind, args.rounds, args.steps)
                except Exception as err:  # noqa: BLE001 - a failing pair is recorded, not fatal
                    report["results"][key] = error_fields(err)
                    write_json(args.json, report, indent=1)
                    print(f"{model_name:11} {kind:7} FAILED: {report['results'][key]['error'][:100]}",
                          flush=True)
                    free_cuda()
                    continue
                report["results"][key] = results
                write_json(args.json, report, indent=1)
                for name, r in results.items():
                    # "*": thread time includes a spin-waiting sync's GPU time (CUDA, syncs > 0)
                    mark = " " if r["host_us_comparable"] else "*"
                    print(f"{model_name:11} {kind:7} {name:19} {r['kernel_ops']:5d} "
                          f"{r['ops_vs_torch']:+5d} {r['syncs']:5d} {r['python_calls']:8d} "
                          f"{r['host_us']:7.1f}{mark} {_ratio(r):>22} {r['peak_bytes_per_param']:7.1f}"
                          + (f" {r['wall_us']:8.1f} {r['gpu_us']:8.1f}" if cuda else ""),
                          flush=True)
        if cuda:
            print("* host us counts GPU time here: a CUDA sync spin-waits on the CPU (syncs > 0); "
                  "compare host us only between rows without '*'.")
        if args.forward:
            try:
                report["forward"] = forward_cost(args.rounds)
            except Exception as err:  # noqa: BLE001 - recorded, not fatal
                report["forward"] = error_fields(err)
                print(f"\nMLP forward + loss: FAILED: {report['forward']['error'][:100]}")
            else:
                print(f"\nMLP forward + loss, per call ({args.rounds} interleaved rounds of 50):")
                for name, r in report["forward"].items():
                    print(f"  {name:38} {r['forward_us']:7.1f} us  {r['extra_us']:+6.1f} us  "
                          f"{_ratio(r)}")
            write_json(args.json, report, indent=1)
    write_json(args.json, report, indent=1)


if __name__ == "__main__":
    main()
