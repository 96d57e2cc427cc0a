"""FP8 training speed: ampkit.fp8 against bf16 autocast and torchao.float8, in one run.

Two levels, both on the shapes of the project's reference H200 figures (BENCHMARKS.md):
- GEMM: bf16 ``mm`` against fp8 GEMMs with pre-cast operands, with a dynamic cast of
  the activation (weight cast once, as Float8Linear does per step), and with dynamic
  casts of both operands; the casting variants are torch.compile'd.
- Model: one training step (bf16 autocast forward, backward, AdamW) of a 4-layer
  8192-wide MLP on 16384 rows and of a GPT (d=1024, 12 layers, seq 1024, batch 16),
  for bf16 autocast, ampkit fp8 per recipe and torchao 0.17 float8 (when importable;
  skipped with a note otherwise), each eager and compiled.

Timing (CUDA): warm-up steps (compilation included), then CUDA events around each
step, median of ``--iters`` (20); peak memory from torch.cuda.max_memory_allocated
after a reset. On CPU the emulated path runs and perf_counter times it: a smoke test,
not a speed measurement. Ratios compare variants within this one run.

On CUDA the models are converted on the device with ``Float8Config(emulate=False)`` (a
GPU without fp8 tensor cores fails the ampkit rows rather than timing emulation), and
each ampkit row records ``fp8_native``: whether every Float8Linear ran on fp8 tensor
cores. Inductor's GEMM backends are ATEN only (``--gemm-backends``; torch 2.11 otherwise
autotunes Triton templates for ``_scaled_mm`` on big GPUs even without max-autotune), so
compiled rows call cuBLAS like the eager ones and compile in seconds.

The JSON is rewritten after every GEMM shape and model row; a case that raises is an
error entry and the next one runs; an interrupt (SIGINT/SIGTERM) writes what was
measured and exits 130.

    PYTHONPATH=src python3 benchmarks/bench_fp8.py [--only gemm,mlp,gpt] [--variants ...]
    PYTHONPATH=src python3 benchmarks/bench_fp8.py --only gemm --json out/fp8_gemm.json
    PYTHONPATH=src python3 benchmarks/bench_fp8.py --quick --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

# Before torch: inductor reads this when its config is first imported (main() sets the
# config too, from --gemm-backends).
os.environ.setdefault("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", "ATEN")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from ampkit._torch_compat import dynamo_reset  # noqa: E402
from ampkit import _measure as harness  # noqa: E402
from ampkit.fp8 import Float8Config, convert_to_fp8  # noqa: E402
from ampkit.fp8.linear import fp8_mm  # noqa: E402
from ampkit.fp8.linear import Float8Linear  # noqa: E402
from ampkit.fp8.scaling import E4M3, quantize  # noqa: E402
from _incremental import error_fields, interrupted, write_json  # noqa: E402

try:  # the reference implementation; brought along as a wheel on the GPU machine
    import torchao
    from torchao.float8 import convert_to_float8_training
    TORCHAO: Optional[str] = getattr(torchao, "__version__", "unknown")
except Exception as err:  # noqa: BLE001 - any import failure means "not available"
    convert_to_float8_training = None
    TORCHAO = None
    TORCHAO_NOTE = f"torchao.float8 not importable ({type(err).__name__}: {err}); torchao rows skipped"
else:
    TORCHAO_NOTE = f"torchao {TORCHAO}"

# GPU.md: the GPT's GEMMs at 16384 rows (K x N), and the 8192-square MLP layer.
GEMM_SHAPES = [(16384, 1024, 3072), (16384, 1024, 1024), (16384, 1024, 4096),
               (16384, 4096, 1024), (16384, 1024, 32768), (16384, 8192, 8192), (8192, 8192, 8192)]
QUICK_GEMM_SHAPES = [(64, 64, 128), (64, 128, 64)]
ALL_VARIANTS = ["bf16", "bf16+compile", "ampkit-tensorwise", "ampkit-tensorwise+compile",
                "ampkit-tensorwise-fastaccum+compile", "ampkit-delayed+compile",
                "ampkit-rowwise+compile", "torchao", "torchao+compile"]
REFERENCE = "bf16+compile"


# --- timing ------------------------------------------------------------------------------

class Timer:
    """Median time of a step and the peak memory while it ran: ampkit's bench harness
    (``ampkit._measure.time_steps``: CUDA events on CUDA, one sync at the end)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        harness.synchronize(self.device)

    def measure(self, step: Callable[[], object], warmup: int, iters: int) -> dict:
        for _ in range(warmup):
            step()
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        times = harness.time_steps(step, self.device, iters)
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None
        return {"ms": statistics.median(times), "ms_min": min(times), "peak_gib": peak}


def free_memory() -> None:
    gc.collect()
    dynamo_reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- GEMM level -----------------------------------------------------------------------------

def gemm_cases(m: int, k: int, n: int, device: torch.device, native: bool,
               compile_fn: Callable) -> dict[str, Callable[[], Tensor]]:
    """The GEMM variants at one shape; x is (m, k), the weight (n, k) as in nn.Linear."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    xq, wq = quantize(x, E4M3), quantize(w, E4M3)
    bf16 = torch.bfloat16
    dyn_x = compile_fn(lambda a: fp8_mm(quantize(a, E4M3), wq.t(), bf16, native))
    dyn_both = compile_fn(lambda a, b: fp8_mm(quantize(a, E4M3), quantize(b, E4M3).t(), bf16, native))
    return {
        "bf16": lambda: torch.mm(x, w.t()),
        "fp8 pre-cast": lambda: fp8_mm(xq, wq.t(), bf16, native),
        "fp8 cast x (compiled)": lambda: dyn_x(x),
        "fp8 cast x+w (compiled)": lambda: dyn_both(x, w),
    }


def run_gemms(shapes: list, device: torch.device, native: bool, compile_fn: Callable,
              timer: Timer, warmup: int, iters: int,
              on_row: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """One row per shape; a case that raises goes to the row's "errors" (name: message)
    and the others are still timed; ``on_row(row)`` after each shape."""
    rows = []
    for m, k, n in shapes:
        times: dict[str, float] = {}
        errors: dict[str, str] = {}
        try:
            cases = gemm_cases(m, k, n, device, native, compile_fn)
        except Exception as err:  # noqa: BLE001 - e.g. out of memory making the operands
            cases, errors["setup"] = {}, error_fields(err)["error"]
        for name, fn in cases.items():
            try:
                times[name] = timer.measure(fn, warmup, iters)["ms"]
            except Exception as err:  # noqa: BLE001 - a failing case is recorded, not fatal
                errors[name] = error_fields(err)["error"]
        flop = 2.0 * m * k * n
        base = times.get("bf16")
        row = {"shape": [m, k, n], "ms": times,
               "tflops": {name: flop / (t * 1e-3) / 1e12 for name, t in times.items()},
               "speedup_vs_bf16": ({name: base / t for name, t in times.items()}
                                   if base else {})}
        if errors:
            row["errors"] = errors
        rows.append(row)
        cells = "  ".join(f"{name} {t:.3f} ms" + (f" ({base / t:.2f}x)" if base else "")
                          for name, t in times.items())
        print(f"  gemm {str((m, k, n)):<22} {cells}"
              + "".join(f"  [{name} FAILED: {e[:80]}]" for name, e in errors.items()), flush=True)
        if on_row:
            on_row(row)
        del cases
        free_memory()
    return rows


# --- models ---------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm transformer block: causal SDPA attention and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A small GPT-2-style language model (learned positions, untied head)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@dataclass(frozen=True)
class ModelSpec:
    """A model factory, one fixed batch, and its loss."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device], tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]


def mlp_spec(quick: bool) -> ModelSpec:
    width, rows, layers = (64, 64, 4) if quick else (8192, 16384, 4)

    def build() -> nn.Module:
        mods: list[nn.Module] = []
        for i in range(layers):
            mods += [nn.Linear(width, width)] + ([nn.ReLU()] if i < layers - 1 else [])
        return nn.Sequential(*mods)

    def batch(device: torch.device) -> tuple[Tensor, Tensor]:
        gen = torch.Generator(device=device).manual_seed(0)
        return (torch.randn(rows, width, device=device, generator=gen),
                torch.randn(rows, width, device=device, generator=gen))
    return ModelSpec("mlp", f"MLP {layers}x{width}^2, {rows} rows", build, batch,
                     lambda out, y: F.mse_loss(out.float(), y))


def gpt_spec(quick: bool) -> ModelSpec:
    vocab, d, layers, heads, seq, bsz = (256, 64, 1, 4, 32, 2) if quick else (32768, 1024, 12, 16, 1024, 16)

    def batch(device: torch.device) -> tuple[Tensor, Tensor]:
        gen = torch.Generator(device=device).manual_seed(0)
        idx = torch.randint(0, vocab, (bsz, seq + 1), device=device, generator=gen)
        return idx[:, :-1], idx[:, 1:]
    return ModelSpec("gpt", f"GPT d={d}, {layers} layers, seq {seq}, batch {bsz}, vocab {vocab}",
                     lambda: GPT(vocab, d, layers, heads, seq), batch,
                     lambda out, y: F.cross_entropy(out.float().flatten(0, 1), y.flatten()))


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def prepare(variant: str, model: nn.Module, device: torch.device) -> nn.Module:
    """Convert a fresh fp32 model, already on ``device``, for one variant (compilation is
    applied by the caller). On CUDA ampkit converts with emulate=False: a GPU without fp8
    tensor cores raises here (an error row) instead of timing the emulation."""
    base = variant.split("+")[0]
    emulate = False if device.type == "cuda" else True
    if base.startswith("ampkit-"):
        recipe = base.split("-")[1]
        config = Float8Config(recipe, emulate=emulate, output_fast_accum=base.endswith("fastaccum"))
        return convert_to_fp8(model, recipe=config)
    if base == "torchao":
        if convert_to_float8_training is None:
            raise RuntimeError(TORCHAO_NOTE)
        return convert_to_float8_training(model, module_filter_fn=fp8_filter)
    return model


def fp8_backend(model: nn.Module) -> dict:
    """How many layers run in fp8 and, for ampkit's, whether all of them ran natively
    (``Float8Linear.native``: torch._scaled_mm on fp8 tensor cores, not emulated)."""
    ampkit_layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    other = [m for m in model.modules()
             if type(m).__name__ == "Float8Linear" and not isinstance(m, Float8Linear)]
    if ampkit_layers:
        return {"fp8_layers": len(ampkit_layers),
                "fp8_native": all(m.native for m in ampkit_layers)}
    # torchao's Float8Linear always calls torch._scaled_mm: native where it runs at all.
    return {"fp8_layers": len(other), "fp8_native": None}


def make_step(model: nn.Module, spec: ModelSpec, device: torch.device,
              compile_fn: Optional[Callable]) -> tuple[Callable[[], Tensor], list]:
    """One training step (bf16 autocast forward, fp32 loss, backward, AdamW)."""
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)
    forward = compile_fn(model) if compile_fn else model
    x, y = spec.batch(device)
    losses: list = []

    def step() -> Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = forward(x)
        loss = spec.loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        return loss
    return step, losses


def run_variant(spec: ModelSpec, variant: str, device: torch.device, compile_fn: Callable,
                timer: Timer, warmup: int, iters: int) -> dict:
    torch.manual_seed(0)
    model = prepare(variant, spec.build().to(device), device)
    step, losses = make_step(model, spec, device, compile_fn if variant.endswith("+compile") else None)
    result = timer.measure(step, warmup, iters)
    result["loss_first"], result["loss_last"] = float(losses[0]), float(losses[-1])
    result.update(fp8_backend(model))
    return result


def run_models(specs: list[ModelSpec], variants: list[str], device: torch.device,
               compile_fn: Callable, timer: Timer, warmup: int, iters: int,
               rows: Optional[list[dict]] = None,
               on_row: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """One row per model and variant, appended to ``rows``; ``on_row(row)`` after each."""
    rows = [] if rows is None else rows
    for spec in specs:
        for variant in variants:
            row = {"model": spec.name, "description": spec.description, "variant": variant}
            try:
                row.update(run_variant(spec, variant, device, compile_fn, timer, warmup, iters))
            except Exception as err:  # noqa: BLE001 - a failing variant is recorded, not fatal
                row.update(error_fields(err))
            native = "" if row.get("fp8_native") is None else \
                f"  fp8 {'native' if row['fp8_native'] else 'EMULATED'} ({row['fp8_layers']} layers)"
            print(f"  {spec.name:<4} {variant:<38} "
                  + (f"{row['ms']:9.2f} ms{native}" if "ms" in row else row["error"][:90]),
                  flush=True)
            rows.append(row)
            add_ratios([r for r in rows if r["model"] == spec.name])
            if on_row:
                on_row(row)
            free_memory()
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Speed-up of each variant over compiled bf16 (the issue's reference) and torchao."""
    by_name = {r["variant"]: r for r in rows if "ms" in r}
    for row in rows:
        if "ms" not in row:
            continue
        for ref, key in ((REFERENCE, "speedup_vs_bf16_compiled"), ("bf16", "speedup_vs_bf16_eager"),
                         ("torchao+compile", "speedup_vs_torchao_compiled")):
            if ref in by_name:
                row[key] = by_name[ref]["ms"] / row["ms"]


# --- report ---------------------------------------------------------------------------------

def print_tables(gemms: list[dict], models: list[dict], meta: dict) -> None:
    print(f"\nfp8 benchmark, {meta['device_name']}, torch {meta['torch']}, {meta['torchao']}"
          + ("  [CPU: emulated fp8, smoke test only]" if meta["device"] == "cpu" else ""))
    if gemms:
        names = list(dict.fromkeys(n for row in gemms for n in row["ms"]))
        print("\nGEMM (M,K,N)          " + "".join(f"{n:>26}" for n in names))
        for row in gemms:
            cells = "".join(f"{row['ms'][n]:>10.3f} ms {row['speedup_vs_bf16'].get(n, float('nan')):>5.2f}x"
                            f" {row['tflops'][n]:>5.0f}T" if n in row["ms"] else f"{'failed':>26}"
                            for n in names)
            print(f"{str(tuple(row['shape'])):<22}{cells}")
    if models:
        print(f"\n{'model':<6}{'variant':<38}{'ms/step':>10}{'peak GiB':>10}"
              f"{'vs bf16c':>10}{'vs aoc':>8}{'loss':>10}")
        for r in models:
            if "ms" not in r:
                print(f"{r['model']:<6}{r['variant']:<38}  skipped: {r['error'][:70]}")
                continue
            peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
            ratio = lambda k: f"{r[k]:.2f}x" if k in r else "-"  # noqa: E731
            print(f"{r['model']:<6}{r['variant']:<38}{r['ms']:>10.2f}{peak:>10}"
                  f"{ratio('speedup_vs_bf16_compiled'):>10}{ratio('speedup_vs_torchao_compiled'):>8}"
                  f"{r['loss_last']:>10.4f}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps: a smoke test")
    parser.add_argument("--only", default="gemm,mlp,gpt", help="comma list of gemm, mlp, gpt")
    parser.add_argument("--variants", default=",".join(ALL_VARIANTS),
                        help=f"comma list of model variants; valid: {', '.join(ALL_VARIANTS)}")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default inductor; aot_eager for --quick on cpu)")
    parser.add_argument("--gemm-backends", default="ATEN",
                        help="inductor's max_autotune_gemm_backends (default ATEN: cuBLAS, no "
                        "Triton GEMM templates to autotune; torch's own default ATEN,TRITON,CPP)")
    parser.add_argument("--json", default="out/bench_fp8.json")
    args = parser.parse_args(argv)
    bad = [v for v in args.variants.split(",") if v not in ALL_VARIANTS]
    if bad:
        parser.error(f"unknown variant(s) {bad}; valid: {', '.join(ALL_VARIANTS)}")
    if args.quick:  # two warm-up steps: the delayed recipe compiles twice (warm-up step)
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 2)
        if args.device == "cpu":
            torch.set_num_threads(1)  # tiny ops: threads only add synchronisation
    if args.backend is None:
        args.backend = "aot_eager" if args.quick and args.device == "cpu" else "inductor"
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    native = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    compile_fn = lambda fn: torch.compile(fn, backend=args.backend)  # noqa: E731
    timer, only = Timer(device), args.only.split(",")
    if args.backend == "inductor":
        import torch._inductor.config as inductor_config
        inductor_config.max_autotune_gemm_backends = args.gemm_backends
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
            "torchao": TORCHAO_NOTE, "device": device.type, "backend": args.backend,
            "gemm_backends": args.gemm_backends if args.backend == "inductor" else None,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "native_fp8": native, "iters": args.iters, "warmup": args.warmup, "quick": args.quick}
    print(f"bench_fp8: {meta['device_name']}, native fp8 {native}, backend {args.backend}, "
          f"GEMM backends {meta['gemm_backends']}", flush=True)
    document: dict = {"meta": meta, "gemm": [], "models": []}
    save = lambda: write_json(args.json, document)  # noqa: E731

    def save_interrupted() -> None:
        document["meta"]["interrupted"] = True
        save()

    with interrupted(save_interrupted, "bench_fp8"):
        if "gemm" in only:
            run_gemms(QUICK_GEMM_SHAPES if args.quick else GEMM_SHAPES, device, native,
                      compile_fn, timer, args.warmup, args.iters,
                      on_row=lambda row: (document["gemm"].append(row), save()))
        specs = [spec(args.quick) for name, spec in (("mlp", mlp_spec), ("gpt", gpt_spec))
                 if name in only]
        run_models(specs, args.variants.split(","), device, compile_fn, timer, args.warmup,
                   args.iters, rows=document["models"], on_row=lambda row: save())
    save()
    print_tables(document["gemm"], document["models"], meta)
    print(f"\nfull results: {args.json}")


if __name__ == "__main__":
    main()
