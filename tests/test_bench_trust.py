"""ampkit bench you can trust: rounds, intervals, threads, machine load, the recommendation.

The statistics and the round schedule are checked on made-up numbers (exact answers);
the command is checked on whatever this machine measures: the recommendation must obey
autotune's rule on the numbers of that same run, never a hard-coded answer.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from ampkit._dtypes import device_policies
from ampkit import _measure as measure
from ampkit.bench import recommend, verdict
from ampkit.bench.compare import compare
from ampkit.bench.runner import BenchSettings, play_rounds, stable
from ampkit.cli import main

TINY = ["--model", "mlp", "--batch-size", "8", "--warmup", "1", "--quiet"]
HAS_MATPLOTLIB = __import__("importlib").util.find_spec("matplotlib") is not None


# --- statistics ---------------------------------------------------------------------------------
def test_median_interval_is_the_order_statistics_of_a_binomial():
    assert measure.median_interval([float(v) for v in range(1, 11)]) == (2.0, 9.0)  # 97.9%
    assert measure.median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)     # 96.9%
    assert measure.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # 93.8% at best
    lo, hi = measure.median_interval([float(v) for v in range(100)])
    assert (lo, hi) == (39.0, 60.0)  # ranks 40 and 61 of 100


def test_paired_rounds_cancel_drift_that_hits_both():
    # The machine slows down tenfold over the run; each round's pair stays 2:1.
    reference = [10.0 * (1 + r) for r in range(8)]
    policy = [5.0 * (1 + r) for r in range(8)]
    speedup, interval = measure.paired_speedup(reference, policy)
    assert speedup == 2.0 and interval == (2.0, 2.0)
    assert measure.half_width(speedup, interval) == 0.0
    assert measure.half_width(1.0, None) == math.inf


def test_memory_meter_charges_each_run_only_its_own_memory():
    meters = [measure.MemoryMeter(torch.device("cpu")) for _ in range(2)]
    if not meters[0].resettable:
        pytest.skip("peak RSS cannot be reset here (/proc/self/clear_refs)")
    kept = []
    with meters[0].track():
        kept.append(torch.ones(16 << 20))  # 64 MiB, held between its stretches
    with meters[1].track():
        transient = torch.ones(2 << 20)  # 8 MiB, freed within the stretch
        del transient
    with meters[0].track():
        pass
    assert meters[0].peak_mib() > 56
    assert meters[1].peak_mib() < 40  # the other run's 64 MiB is not charged to it


# --- the round schedule -------------------------------------------------------------------------
class FakeRun:
    """Stands in for a PolicyRun: logs the order of its rounds, returns given times."""

    def __init__(self, name: str, log: list, ms) -> None:
        self.name, self.log, self.ms, self.round_ms = name, log, ms, []

    def warm_up(self) -> None:
        self.log.append(("warm", self.name))

    def run(self, steps: int) -> list[float]:
        self.log.append((self.name, steps))
        times = [self.ms(len(self.round_ms))] * steps
        self.round_ms.append(times[0])
        return times


def _runs(log: list, noisy: bool) -> list[FakeRun]:
    noise = (lambda r: 10.0 + 5 * (r % 3)) if noisy else (lambda r: 10.0)
    return [FakeRun("A", log, lambda r: 10.0), FakeRun("B", log, noise), FakeRun("C", log, noise)]


def test_rounds_take_turns_in_a_rotating_order_and_cover_exactly_the_steps():
    log: list = []
    runs = _runs(log, noisy=False)
    ticks: list = []
    played = play_rounds(runs, BenchSettings(steps=5, round_steps=2),
                         [lambda d, t: ticks.append((d, t))] * 3)
    assert played == 3
    assert log[:3] == [("warm", "A"), ("warm", "B"), ("warm", "C")]
    assert log[3:] == [("A", 2), ("B", 2), ("C", 2), ("B", 2), ("C", 2), ("A", 2),
                       ("C", 1), ("A", 1), ("B", 1)]
    assert ticks[-1] == (8, 8)  # 3 warm-up + 5 timed steps


def test_more_rounds_only_while_unstable_and_within_the_limits():
    log: list = []
    steady = _runs(log, noisy=False)
    assert play_rounds(steady, BenchSettings(steps=12, max_time=60), [lambda d, t: None] * 3) == 6
    assert stable(steady)
    noisy = _runs([], noisy=True)
    start = time.perf_counter()
    played = play_rounds(noisy, BenchSettings(steps=12, max_time=30), [lambda d, t: None] * 3)
    # Bounded by stability and the budget alone: a cap of 5x --steps (30 rounds) stopped
    # fast steps after a fraction of the budget, still unstable, and the verdict then
    # advised a larger budget. These reach ±5% after 42 rounds.
    assert played == 42 and stable(noisy) and time.perf_counter() - start < 10
    assert play_rounds(_runs([], noisy=True), BenchSettings(steps=12, max_time=0),
                       [lambda d, t: None] * 3) == 6  # no budget: exactly --steps


# --- the recommendation rule --------------------------------------------------------------------
def _result(policy: str, round_ms: list[float], losses: list[float], fp32: bool = False) -> dict:
    return {"policy": policy, "pure_fp32": fp32, "interleaved": True, "round_ms": round_ms,
            "step_ms": sorted(round_ms)[len(round_ms) // 2], "losses": losses,
            "peak_mem_mib": 10.0}


def test_recommend_applies_autotunes_rule_against_the_fp32_row_wherever_it_is():
    fp32 = _result("32-true", [10.0] * 8, [2.0, 1.0], fp32=True)
    fast_far = _result("bf16-mixed", [5.0] * 8, [2.0, 1.1])      # 2x, loss 10% away
    fast_near = _result("O2", [8.0] * 8, [2.0, 1.001])           # 1.25x, within 2%
    slow = _result("16-mixed", [12.0] * 8, [2.0, 1.0])
    rec = recommend([fast_far, fp32, fast_near, slow])  # fp32 need not be first
    assert rec["recommended"] == "O2" and rec["speedup"] == pytest.approx(1.25)
    assert [r["policy"] for r in rec["rows"]] == ["32-true", "bf16-mixed", "O2", "16-mixed"]
    assert [r["accepted"] for r in rec["rows"]] == [True, False, True, False]
    assert recommend([fp32, slow])["recommended"] == "32-true"
    none = recommend([fast_far, slow])
    assert none["recommended"] is None and "add 32-true" in none["reason"]
    assert verdict.recommendation_sentence(none, []).startswith("Recommendation: none.")


def test_a_policy_whose_own_median_is_slower_than_fp32s_is_never_recommended():
    """The rule read only the paired speedup: with 2 rounds, one outlier round (3x faster)
    made bf16-mixed the recommendation while its step_ms in the same JSON was above fp32's."""
    fp32 = _result("32-true", [10.0, 10.0], [2.0, 1.0], fp32=True)
    outlier = _result("bf16-mixed", [11.0, 2.0], [2.0, 1.0])  # median (step_ms) 11 > 10
    assert outlier["step_ms"] > fp32["step_ms"]
    rec = recommend([fp32, outlier])
    assert rec["recommended"] == "32-true"
    assert rec["rows"][1]["accepted"] is False and "no faster than fp32" in rec["rows"][1]["reason"]
    assert rec["rows"][1]["speedup"] == pytest.approx(10 / 11)  # the JSON agrees with itself


# --- the command, on whatever this machine measures ---------------------------------------------
def _bench(tmp_path, capsys, *argv: str) -> tuple[dict, list[str]]:
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out.splitlines()


def test_bench_recommends_by_the_rule_on_what_it_measured(tmp_path, capsys):
    doc, lines = _bench(tmp_path, capsys, "--policies", "32-true,bf16-mixed,O2", "--steps", "12",
                        "--max-time", "0", "--isolate", "never", "--threads", "1")
    results = {r["policy"]: r for r in doc["results"]}
    chosen = doc["recommended"]
    assert chosen in results and chosen == doc["recommendation"]["recommended"]
    rule_row = next(r for r in doc["recommendation"]["rows"] if r["policy"] == chosen)
    if chosen != "32-true":  # never slower than fp32 in this run, never beyond the tolerance
        assert rule_row["speedup"] >= 1 and rule_row["max_loss_dev"] <= 0.02
    assert recommend(doc["results"])["recommended"] == chosen  # the same rule, recomputed
    for r in doc["results"]:
        assert len(r["round_ms"]) == 6 and len(r["step_times_ms"]) == 12
        lo, hi = r["speedup_ci"]
        assert lo <= r["speedup"] <= hi
    assert doc["stability"]["rounds"] == 6 and isinstance(doc["stability"]["stable"], bool)
    assert (doc["settings"]["threads"], doc["settings"]["threads_reason"]) == (1, "1, as asked (--threads)")
    assert {"cpus", "loadavg_1m", "busy", "governor"} <= doc["machine"].keys()
    assert lines[-1].startswith(f"Recommendation: {chosen} here")
    if not doc["recommendation"]["trustworthy"]:
        assert "Provisional:" in lines[-1]
    table = lines[:lines.index(next(line for line in lines if line.startswith("Device ")))]
    assert max(len(line) for line in table) <= 80, table


@pytest.mark.slow  # a process per candidate: 12 s; CI's slow run keeps it
def test_bench_auto_runs_the_autotune_candidates_in_their_own_processes(tmp_path, capsys):
    doc, _ = _bench(tmp_path, capsys, "--policies", "auto", "--steps", "2", "--max-time", "0")
    assert doc["settings"]["policies"] == list(device_policies("cpu").candidates)
    assert doc["settings"]["process_per_policy"] is True
    assert doc["settings"]["threads"] == 1  # the default for a small model on a CPU
    assert "small model" in doc["settings"]["threads_reason"]
    for r in doc["results"]:
        assert r["memory_method"].endswith("in a process of its own per policy")
        assert r["peak_mem_mib"] > 0 and len(r["round_ms"]) == 1
        assert r["speedup_ci"] is None  # one round: too few for an interval
    assert doc["stability"]["stable"] is (len(doc["results"]) == 1)


def _fail_policy(monkeypatch, label: str, where: str) -> None:
    """Make one policy raise: while building its model ("build") or on its third step."""
    from ampkit.bench import runner

    if where == "build":
        original_build = runner.build

        def build(spec, *args, **kwargs):
            if spec.label == label:
                raise RuntimeError(f"injected failure building {label}")
            return original_build(spec, *args, **kwargs)
        monkeypatch.setattr(runner, "build", build)
        return
    original_step = runner.PolicyRun._step

    def step(self):
        if self.label == label and len(self.losses) == 2:
            raise torch.cuda.OutOfMemoryError(f"injected failure stepping {label}")
        return original_step(self)
    monkeypatch.setattr(runner.PolicyRun, "_step", step)


@pytest.mark.parametrize("compiled", [False, True], ids=["rounds", "one-after-another"])
def test_a_failing_policy_is_an_error_row_and_the_others_still_report(
        tmp_path, capsys, monkeypatch, compiled):
    _fail_policy(monkeypatch, "bf16-mixed", "step")
    if compiled:  # --compile in one process: the policies run one after another
        monkeypatch.setattr("ampkit.bench.runner.torch.compile", lambda model: model)
    plot = tmp_path / "bench.png"
    argv = ["--policies", "32-true,bf16-mixed,O2", "--steps", "4", "--max-time", "0",
            "--isolate", "never", "--threads", "1"] + (["--compile", "--warmup", "2"] if compiled
                                                       else [])
    if HAS_MATPLOTLIB:
        argv += ["--plot", str(plot)]
    doc, lines = _bench(tmp_path, capsys, *argv)
    assert [r["policy"] for r in doc["results"]] == ["32-true", "bf16-mixed", "O2"]
    assert doc["settings"]["policies"] == ["32-true", "bf16-mixed", "O2"]
    bad = doc["results"][1]
    assert bad["error"] == "OutOfMemoryError: injected failure stepping bf16-mixed"
    assert "step_ms" not in bad and "Traceback" in bad["traceback"]
    for r in (doc["results"][0], doc["results"][2]):  # measured in full, compared to 32-true
        assert "error" not in r and r["speedup"] is not None
        assert len(r["step_times_ms"]) == 4 and r["max_loss_dev"] is not None
    assert doc["recommended"] in ("32-true", "O2")
    assert [r["policy"] for r in doc["recommendation"]["rows"]] == ["32-true", "O2"]
    assert any(line.startswith("bf16-mixed FAILED (OutOfMemoryError: injected") for line in lines)
    table = lines[:lines.index(next(line for line in lines if line.startswith("Device ")))]
    assert not any("bf16-mixed" in line for line in table)
    assert lines[-2 if HAS_MATPLOTLIB else -1].startswith("Recommendation: ")
    if HAS_MATPLOTLIB:
        assert plot.stat().st_size > 0


def _interrupted_bench(tmp_path, capsys, policies: str, isolate: str):
    """Run bench (12 steps, rounds of 2) expecting the interrupt a test injected: exit 130,
    its last stderr line saying so; the JSON written and what was printed."""
    path = tmp_path / "bench.json"
    argv = ["bench", *TINY, "--policies", policies, "--steps", "12", "--max-time", "0",
            "--isolate", isolate, "--threads", "1", "--json", str(path)]
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == "ampkit bench: interrupted"
    return json.loads(path.read_text()), captured


def test_an_interrupted_bench_writes_what_it_measured_and_exits_130(tmp_path, capsys,
                                                                   monkeypatch):
    """A time limit's SIGINT (gpu_session.sh runs each part under one) left no JSON and no
    plot: the rounds run before it are reported, written and marked interrupted."""
    from ampkit.bench import runner

    original_step = runner.PolicyRun._step

    def step(self):  # O2's 10th step: after 1 warm-up step and 4 rounds of 2, in the 5th
        if self.label == "O2" and len(self.losses) == 9:
            raise KeyboardInterrupt
        return original_step(self)
    monkeypatch.setattr(runner.PolicyRun, "_step", step)
    doc, captured = _interrupted_bench(tmp_path, capsys, "32-true,bf16-mixed,O2", "never")
    assert doc["interrupted"] is True and doc["verdict"][-1].startswith("Interrupted:")
    assert [r["policy"] for r in doc["results"]] == ["32-true", "bf16-mixed", "O2"]
    # The 5th round (the rotation's second turn: bf16-mixed, O2, 32-true) ended at O2.
    assert [len(r["round_ms"]) for r in doc["results"]] == [4, 5, 4]
    assert all(r["speedup"] is not None for r in doc["results"])
    assert all(r["mem_ratio"] is None and r["mem_ratio_reason"] for r in doc["results"])
    assert "Recommendation:" in captured.out


@pytest.mark.slow  # a worker process imports torch and ampkit: 6 s
def test_an_interrupted_bench_with_a_process_per_policy_writes_what_it_measured(
        tmp_path, capsys, monkeypatch):
    """With a process per policy (the CPU default) an interrupt wrote nothing: the parent
    now collects each worker's rounds, the one it was waiting for included."""
    from ampkit.bench import worker

    original_expect, interrupts = worker.Worker._expect, []

    def expect(self, kind):  # the signal comes while the parent waits for bf16's 3rd round
        if kind == "times" and self.label == "bf16-mixed" and len(self.round_ms) == 2 \
                and not interrupts:
            interrupts.append(kind)
            raise KeyboardInterrupt
        return original_expect(self, kind)
    monkeypatch.setattr(worker.Worker, "_expect", expect)
    doc, captured = _interrupted_bench(tmp_path, capsys, "32-true,bf16-mixed", "always")
    assert interrupts == ["times"] and doc["interrupted"] is True
    assert doc["settings"]["process_per_policy"] is True
    # Rounds 1-3 each ran both policies; the worker finished the round it was asked for.
    assert [len(r["round_ms"]) for r in doc["results"]] == [3, 3]
    assert all(r["memory_method"].endswith("in a process of its own per policy")
               for r in doc["results"])
    assert "Recommendation:" in captured.out


def test_a_failing_reference_leaves_the_next_policy_as_the_reference(tmp_path, capsys,
                                                                        monkeypatch):
    _fail_policy(monkeypatch, "32-true", "build")
    doc, lines = _bench(tmp_path, capsys, "--policies", "32-true,bf16-mixed,O2", "--steps", "4",
                        "--max-time", "0", "--isolate", "never", "--threads", "1")
    ref, other = doc["results"][1], doc["results"][2]
    assert doc["results"][0]["error"] == "RuntimeError: injected failure building 32-true"
    assert ref["speedup"] == 1.0 and other["speedup"] is not None
    assert doc["recommended"] is None  # the rule needs fp32's row
    assert lines[-1].startswith("Recommendation: none.")


def test_every_policy_failing_ends_the_run_with_their_errors(monkeypatch):
    from ampkit.bench.policies import parse_policy_list
    from ampkit.bench.runner import run_bench

    _fail_policy(monkeypatch, "32-true", "build")
    with pytest.raises(RuntimeError, match="every policy failed: 32-true: RuntimeError: injected"):
        run_bench(parse_policy_list("32-true", "cpu"), BenchSettings(model="mlp", steps=2),
                  isolate=False)


@pytest.mark.parametrize("argv, words", [
    (["--threads", "0"], ["--threads", "0", "[1,"]),
    (["--threads", "100000"], ["--threads", "100000", "[1,"]),  # (it crashed the process)
    (["--max-time", "-1"], ["--max-time", "-1"]),
    (["--max-loss-dev", "-0.1"], ["--max-loss-dev", "valid"]),
    (["--max-loss-dev", "nan"], ["--max-loss-dev", "nan"]),
])
def test_bad_trust_settings_exit_2_before_running(capsys, argv, words):
    assert main(["bench", *TINY, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err


def _two_row_document(**half_fields) -> dict:
    """A bench document of 32-true and a 16-true whose loss moved 8%, on a busy machine."""
    ref = {"policy": "32-true", "half_dtype": None, "speedup": 1.0, "speedup_ci": [1.0, 1.0],
           "mem_ratio": 1.0, "max_loss_rel_dev": 0.0, "fp8_recipe": None, "nonfinite_losses": 0,
           "losses": [1.0], "memory_method": "m", "adam_eps": 1e-8, "round_ms": [1.0] * 6,
           "interleaved": True, "pure_fp32": True, "step_ms": 1.0, "peak_mem_mib": 1.0,
           "loss_scaling": "off", "skipped_steps": None, "compile_s": None}
    half = dict(ref, policy="16-true", half_dtype="float16", speedup=1.02, speedup_ci=[0.9, 1.2],
                max_loss_rel_dev=0.08, adam_eps=1e-4, pure_fp32=False, losses=[1.08])
    half.update(half_fields)
    return {"environment": {"device": "cpu", "device_name": "x", "torch": "t", "ampkit": "a",
                            "native": {"bf16": True, "fp16": False, "fp8": False}},
            "results": [ref, half], "workload": "w", "machine": {"busy": True, "loadavg_1m": 3.0,
                                                                  "cpus": 2, "governor": None},
            "settings": {"steps": 6, "warmup": 1, "threads": 1, "max_time": 0}}


def test_the_verdict_flags_doubts_and_far_loss_curves():
    doc = _two_row_document()
    half = doc["results"][1]
    text = " ".join(verdict.complete(doc, 0.02)["verdict"])
    assert "no measurable difference" in text
    assert "moved up to 8% from 32-true's, more than the 2% tolerance" in text
    assert "AdamW eps 0.0001 instead of 1e-8" in text and "(busy)" in text
    assert "Timings NOT stable" in text
    assert doc["recommended"] == "32-true"  # 16-true is too far from fp32's loss
    assert "Provisional: the timings were not stable and the machine was busy" in \
        doc["recommendation"]["sentence"]
    assert "AdamW eps 0.0001" in verdict.notes(half)


def test_the_loss_comparison_does_not_depend_on_how_many_rounds_ran():
    """Δloss was the largest gap over every step run, and rounds are added while the
    timings settle (a busy machine runs more): the same bench rejected bf16 at 96 steps
    and accepted it at 20."""
    from ampkit.bench.policies import parse_policy_list
    from ampkit.bench.runner import BenchSettings, run_bench
    specs = parse_policy_list("32-true,bf16-mixed", "cpu")
    runs = []
    for max_time in (0.0, 1e9):
        settings = BenchSettings(model="mlp", steps=4, warmup=1, round_steps=2, threads=1,
                                 device="cpu", max_time=max_time)
        runs.append(run_bench(specs, settings, isolate=False))
    short, long = runs
    assert len(long[1]["step_times_ms"]) > len(short[1]["step_times_ms"])  # more rounds ran
    assert [r["losses"] for r in long] == [r["losses"] for r in short]
    assert len(short[0]["losses"]) == 5
    assert [r["max_loss_dev"] for r in long] == [r["max_loss_dev"] for r in short]


def test_an_interval_bound_is_never_rounded_onto_or_across_one():
    """"0.78–1.00: slower" read as an interval that includes 1 (its bound was 0.996)."""
    from ampkit.bench.verdict import interval
    assert interval((0.78, 0.996)) == "0.78–0.996"
    assert interval((1.004, 1.2)) == "1.004–1.20"
    assert interval((0.9, 1.02)) == "0.90–1.02" and interval((1.0, 1.0)) == "1.00–1.00"


@pytest.mark.parametrize("rounds, ci, sentence", [
    (2, None, "Timings NOT stable: 2 rounds are too few for a 95% interval, which takes 6; "),
    (6, [0.9, 1.1], "Timings NOT stable: after 6 rounds the widest 95% interval is ±10%, wider "
                    "than the ±5% target; ")])
def test_unstable_timings_are_one_plain_sentence(rounds, ci, sentence):
    """It read "after 2 rounds too few rounds for a 95% interval (6 needed) (target ±5%)"."""
    doc = _two_row_document(speedup=1.0, speedup_ci=ci)
    doc["results"][0]["round_ms"] = [1.0] * rounds
    lines = verdict.complete(doc, 0.02)["verdict"]
    line = next(line for line in lines if line.startswith("Timings NOT stable"))
    assert line.startswith(sentence + "small differences mean nothing here. Try "), line


def test_memory_that_is_not_comparable_gives_no_ratio_and_says_why():
    """bench --nproc on a CPU printed "O2: ..., 0.01× its peak memory" for policies that
    shared one process per rank, below a note that they had."""
    doc = _two_row_document(round_ms=[0.9] * 6, step_ms=0.9, losses=[1.001], peak_mem_mib=0.01)
    for row in doc["results"]:
        row["mem_ratio_reason"] = "they shared a process"
    compare(doc["results"])  # the half row: faster, its loss within 0.1%: recommended
    assert [r["mem_ratio"] for r in doc["results"]] == [None, None]
    text = "\n".join(verdict.complete(doc, 0.02)["verdict"])
    assert "its peak memory" not in text and "No memory ratios: they shared a process." in text
    assert "and memory relative to" not in text
    assert doc["recommendation"]["rows"][1]["mem_ratio"] is None
    assert doc["recommended"] == "16-true"
    assert "its peak memory" not in doc["recommendation"]["sentence"]
    assert verdict.bench_rows(doc["results"])[1][4] == "-"


def test_an_interrupted_parent_reads_a_workers_owed_answer_and_waits_for_it_boundedly(
        monkeypatch, tmp_path):
    """The answer owed for a command is recorded before the command is written, so an
    interrupt right after the write still reads it; and a wait for one that never comes
    (an interrupt between the write and the bookkeeping) ends, failing that worker."""
    import os
    import tempfile
    from ampkit.bench import worker

    def make():
        commands, answers = os.pipe(), os.pipe()
        log, fallback = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        handle = worker.Worker("bf16-mixed", commands[1], answers[0], log, fallback)
        return handle, os.fdopen(answers[1], "w"), os.fdopen(commands[0], "r")
    handle, answers, commands = make()
    handle._send("run 2")
    assert commands.readline() == "run 2\n"
    answers.write("times [1.0, 2.0]\n")
    answers.flush()
    handle.settle()  # the owed times, read and set aside
    handle.settle()  # nothing owed any more: returns at once
    monkeypatch.setattr(worker, "_SETTLE_S", 0.05)
    silent, _, _ = make()
    silent._send("run 2")
    with pytest.raises(RuntimeError, match=r"policy 'bf16-mixed' failed in its own process"):
        silent.settle()


def test_policies_taking_turns_in_one_process_draw_the_same_dropout_masks(tmp_path, monkeypatch):
    """They drew from one generator in turn: two runs of one policy on a model with dropout
    differed by 1.4-6% in loss (`--isolate never`, CUDA's default, and --nproc)."""
    from ampkit.bench.policies import parse_policy
    from ampkit.bench.runner import PolicyRun

    (tmp_path / "bench_dropout_models.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "def make():\n"
        "    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 4))\n"
        "    return model, (torch.randn(16, 8), torch.randn(16, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = BenchSettings(model="bench_dropout_models:make", steps=3, warmup=1)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)  # as the command seeds before a user function makes the model
        runs.append(PolicyRun(parse_policy("32-true", "cpu"), settings))
    for run in runs:
        run.warm_up()
    for _ in range(2):
        for run in runs:
            run.run(2)
    first, second = (torch.stack(run.losses) for run in runs)
    assert torch.equal(first, second)
