"""The ampkit command: bench, train, info, --version, run as a user would (tiny sizes, CPU).

Subprocess tests run ``python -m ampkit.cli`` and check exit codes and JSON; the many
bad-value cases call ``main()`` in-process (same code, no interpreter start each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ampkit
from ampkit.bench import report, verdict
from ampkit.bench.errors import UsageError
from ampkit.bench.policies import loss_scaling_label, parse_policy, parse_policy_list
from ampkit.bench.precision import adam_eps
from ampkit.bench.runner import BenchSettings, run_policy
from ampkit.bench.train import TrainSettings, train
from ampkit._dtypes import recommend_policy
from ampkit.cli import main

SRC = str(Path(ampkit.__file__).resolve().parent.parent)
HAS_SKLEARN = __import__("importlib").util.find_spec("sklearn") is not None
HAS_MATPLOTLIB = __import__("importlib").util.find_spec("matplotlib") is not None
needs_sklearn = pytest.mark.skipif(not HAS_SKLEARN, reason="digits need scikit-learn (cli extra)")
TINY = ["--model", "mlp", "--steps", "3", "--warmup", "1", "--batch-size", "8", "--max-time", "0",
        "--quiet"]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "ampkit.cli", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


def usage_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """Run main() in-process; assert exit 2 with one stderr line and nothing on stdout (a
    refusal comes before any output: train printed its run header first); return that line."""
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert out == "", out
    return lines[0]


# --- version, help, info -------------------------------------------------------------------
def test_version_help_and_info_run_as_a_user_would(capsys):
    version = run_cli("--version")  # one real process: `python -m ampkit.cli` works
    assert (version.returncode, version.stdout.strip()) == (0, f"ampkit {ampkit.__version__}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    short = subprocess.run([sys.executable, "-m", "ampkit", "--version"], capture_output=True,
                           text=True, env=env, timeout=120)  # and `python -m ampkit` (it did not)
    assert (short.returncode, short.stdout) == (0, version.stdout)
    assert main(["bench", "--help"]) == 0
    helped = capsys.readouterr().out
    assert "--policies" in helped and "fp8" in helped
    assert main(["info"]) == 0
    info = capsys.readouterr().out
    assert f"torch {torch.__version__}" in info
    assert "device: cpu" in info and "native bf16:" in info
    assert "fp8 attention: emulated: cpu (" in info and "has no fp8 tensor cores" in info
    policy, reason = recommend_policy("cpu")
    assert f"recommended policy: {policy} ({reason})" in " ".join(info.split())


def test_help_of_each_command(capsys):
    for argv in (["--help"], ["train", "--help"], ["info", "--help"]):
        assert main(argv) == 0
    out = capsys.readouterr().out
    for word in ("bench", "train", "info", "--resume", "--opt-level", "--data-dir"):
        assert word in out


# --- bench ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_json_has_every_field_and_compares_to_the_first(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", *TINY, "--policies", "32-true,bf16-mixed,O2,16-mixed",
                   "--isolate", "never", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "bf16-mixed" in proc.stdout and "Peak memory:" in proc.stdout
    # One process for every policy: its peak RSS is no one policy's, so no memory ratios.
    assert ("No memory ratios: every policy ran in this one process, where a later one reuses "
            "heap memory an earlier one freed") in " ".join(proc.stdout.split())
    doc = json.loads(out.read_text())
    assert (doc["device"], doc["torch"], doc["ampkit"]) == ("cpu", torch.__version__,
                                                           ampkit.__version__)
    assert doc["settings"]["steps"] == 3 and doc["settings"]["model"] == "mlp"
    results = doc["results"]
    assert [r["policy"] for r in results] == ["32-true", "bf16-mixed", "O2", "16-mixed"]
    for r in results:
        for key in ("step_ms", "samples_per_s", "peak_mem_mib", "final_loss", "max_loss_dev"):
            assert isinstance(r[key], float), (r["policy"], key)
        assert len(r["losses"]) == 4 and len(r["step_times_ms"]) == 3
        assert r["samples_per_s"] == pytest.approx(8 / r["step_ms"] * 1e3)
    ref, o2, fp16 = results[0], results[2], results[3]
    assert (ref["speedup"], ref["max_loss_dev"], ref["mem_ratio"]) == (1.0, 0.0, None)
    assert all(r["mem_ratio"] is None and r["mem_ratio_reason"].startswith("every policy ran in "
                                                                         "this one process")
               for r in results)
    # Same seeded weights and data: the first step's loss is the fp32 forward, rounded.
    assert abs(o2["losses"][0] - ref["losses"][0]) < 0.05
    assert o2["half_dtype"] == "bfloat16" and o2["loss_scaling"] == "dynamic"  # O2 as initialize applies it
    assert fp16["loss_scaling"] == "dynamic" and fp16["skipped_steps"] == 0
    assert fp16["final_scale"] == 65536.0


@pytest.mark.slow
def test_bench_default_isolates_policies_and_writes_json_to_stdout():
    proc = run_cli("bench", *TINY, "--policies", "32-true,bf16-mixed", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # stdout is the JSON alone; the table went to stderr
    assert doc["settings"]["process_per_policy"] is True
    assert "ampkit bench" in proc.stderr
    assert all(r["peak_mem_mib"] > 0 for r in doc["results"])
    assert doc["results"][0]["memory_method"].endswith("in a process of its own per policy")
    # The child process trained exactly what this process trains with the same settings.
    here = run_policy(parse_policy("bf16-mixed", "cpu"),
                      BenchSettings(model="mlp", steps=3, warmup=1, batch_size=8))
    assert doc["results"][1]["losses"] == here["losses"]
    assert here["compile_s"] is None and here["warmup_ms"] > 0


def test_bench_and_doctor_json_record_the_batch_size_used(tmp_path, capsys):
    """settings.batch_size was null when the model's default was used (--batch-size not given)."""
    bench, doctor = tmp_path / "bench.json", tmp_path / "doctor.json"
    assert main(["bench", *(a for a in TINY if a not in ("--batch-size", "8")), "--policies",
                 "32-true", "--isolate", "never", "--json", str(bench)]) == 0
    assert main(["doctor", "--model", "mlp", "--quiet", "--json", str(doctor)]) == 0
    for path in (bench, doctor):  # the 10-100-10 MLP's default batch on a CPU
        assert json.loads(path.read_text())["settings"]["batch_size"] == 100, path.name
    given = tmp_path / "given.json"
    assert main(["bench", *TINY, "--policies", "32-true", "--isolate", "never", "--json",
                 str(given)]) == 0
    assert json.loads(given.read_text())["settings"]["batch_size"] == 8


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="--plot needs matplotlib (cli extra)")
def test_bench_plot_writes_a_png(tmp_path):
    png = tmp_path / "plots" / "bench.png"
    assert main(["bench", *TINY, "--policies", "32-true,bf16-mixed", "--isolate", "never",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_matplotlib_is_refused_before_running(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    line = usage_error(capsys, "bench", *TINY, "--plot", "out.png")
    assert "matplotlib" in line and "--plot" in line


def test_tables_fall_back_to_plain_text_without_rich(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)
    assert not report.have_rich()
    assert main(["bench", *TINY, "--policies", "32-true,bf16-mixed", "--isolate", "never"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("policy"))
    assert "ms/step" in header and "speedup (95% CI)" in header and "Δloss" in header
    assert any(line.startswith("bf16-mixed ") for line in out)


@pytest.mark.slow
def test_user_workload_from_the_current_directory(tmp_path):
    (tmp_path / "mywork.py").write_text(textwrap.dedent("""
        import torch
        def make(batch_size=4):
            model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
            return model, (torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,)))
        def wrong():
            return torch.nn.Linear(2, 2)
    """))
    out = tmp_path / "r.json"
    proc = run_cli("bench", "--model", "mywork:make", "--steps", "2", "--warmup", "1",
                   "--batch-size", "5", "--policies", "32-true,bf16-mixed", "--isolate", "never",
                   "--json", str(out), "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in results] == ["32-true", "bf16-mixed"]
    assert results[0]["samples_per_s"] == pytest.approx(5 / results[0]["step_ms"] * 1e3)
    bad = run_cli("bench", "--model", "mywork:wrong", "--quiet", cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "returned Linear; expected (torch.nn.Module, (inputs, targets))" in bad.stderr


def test_user_workload_without_a_batch_size_parameter(capsys, tmp_path, monkeypatch):
    (tmp_path / "fixed.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Linear(4, 2), "
        "(torch.randn(3, 4), torch.randn(3, 2))\n")
    monkeypatch.chdir(tmp_path)
    line = usage_error(capsys, "bench", "--model", "fixed:make", "--batch-size", "5")
    assert "--batch-size 5 given, but model 'fixed:make' takes no batch_size keyword" in line


def _document(native_bf16: bool, speedup: float, half_dtype: str = "bfloat16") -> dict:
    row = {"policy": "32-true", "half_dtype": None, "speedup": 1.0, "mem_ratio": 1.0,
           "max_loss_dev": 0.0, "max_loss_rel_dev": 0.0, "fp8_recipe": None, "nonfinite_losses": 0,
           "losses": [1.0],
           "memory_method": "process peak RSS", "speedup_ci": [1.0, 1.0]}
    half = dict(row, policy="bf16-mixed" if half_dtype == "bfloat16" else "O2-fp16",
                half_dtype=half_dtype, speedup=speedup,
                max_loss_dev=0.001, max_loss_rel_dev=0.001,
                speedup_ci=[speedup * 0.9, speedup * 1.05])
    env = {"device": "cpu", "device_name": "x", "torch": "t", "ampkit": "a",
           "native": {"bf16": native_bf16, "fp16": False, "fp8": False}}
    return {"environment": env, "results": [row, half], "workload": "w",
            "settings": {"steps": 3, "warmup": 1}}


def test_verdict_says_why_half_precision_is_slower_on_a_cpu():
    no_hardware = " ".join(verdict.bench_verdict(_document(False, 0.3)))
    assert "bf16-mixed: 0.30× the speed of 32-true (95% interval 0.27–0.32: slower)" in no_hardware
    assert "because this CPU has no native bf16 arithmetic" in no_hardware
    with_hardware = " ".join(verdict.bench_verdict(_document(True, 0.5)))
    assert "although it has native instructions for that half precision" in with_hardware
    # fp16 on a CPU with native bf16 only: it said "although it has native half-precision
    # instructions" where `ampkit info` said "native fp16: no" (new-user probe).
    fp16 = " ".join(verdict.bench_verdict(_document(True, 0.5, "float16")))
    assert "O2-fp16 ran slower than fp32 because this CPU has no native fp16 arithmetic" in fp16
    both = _document(True, 0.5)  # bf16 native, fp16 not: one sentence each (review finding)
    both["results"].append(dict(both["results"][1], policy="O2-fp16", half_dtype="float16"))
    mixed = " ".join(verdict.bench_verdict(both))
    assert "O2-fp16 ran slower than fp32 because this CPU has no native fp16 arithmetic" in mixed
    assert "bf16-mixed ran slower than fp32 on this CPU although it has native" in mixed
    faster = " ".join(verdict.bench_verdict(_document(True, 1.5)))
    assert "1.50× the speed of 32-true (95% interval 1.35–1.58: faster)" in faster
    assert "ran slower" not in faster
    # An interval that includes 1 is no measured slowdown: no explanation of one.
    even = " ".join(verdict.bench_verdict(_document(True, 0.97)))
    assert "no measurable difference" in even and "ran slower" not in even


# --- bad values: exit 2, one line naming the value and the valid ones ----------------------
@pytest.mark.parametrize("argv, words", [
    (["bench", "--model", "vgg"], ["'vgg'", "valid: mlp, cnn, resnet18, gpt"]),
    (["bench", "--policies", "32-true,fp12"], ["'fp12'", "valid:", "bf16-mixed", "fp8"]),
    (["bench", "--policies", "fp8-blockwise"], ["'blockwise'", "tensorwise, delayed, rowwise"]),
    (["bench", "--policies", "O0-bf16"], ["'O0-bf16'", "valid: O0"]),
    (["bench", "--policies", "O2-fp32"], ["'fp32'", "valid:", "bf16"]),
    (["bench", "--policies", "p=bf16,c=f32"], ["'p=bf16,c=f32'", "valid:"]),
    (["bench", "--device", "tpu9"], ["'tpu9'", "valid: cpu"]),
    (["bench", "--steps", "0"], ["--steps", "0"]),
    (["bench", "--steps", "many"], ["'many'", "int"]),
    (["bench", "--model", "mlp", "--compile", "--warmup", "0"], ["--warmup 0", "valid: --warmup 2"]),
    (["bench", "--model", "no_such_module_xyz:make"], ["'no_such_module_xyz'", "valid:"]),
    (["bench", "--model", "json:no_such_function"], ["'no_such_function'", "valid:"]),
    (["bench", "--model", "json:"], ["package.module:function"]),
    (["bench", "--isolate", "sometimes"], ["'sometimes'", "auto", "always", "never"]),
    (["bench", "--model", "mlp", "--json", "/proc/no/such.json"], ["--json", "'/proc/no/such.json'",
                                                                  "cannot be written", "valid:"]),
    (["bench", "--model", "mlp", "--json", "."], ["--json '.'", "it is a folder"]),
    (["train", "--checkpoint", "/proc/no/c.pt"], ["--checkpoint", "cannot be written", "valid:"]),
    (["train", "--data", "mnist"], ["'mnist'", "digits", "cifar10", "synthetic"]),
    (["train", "--data", "synthetic", "--model", "gpt"], ["'gpt'", "valid: mlp, cnn"]),
    (["train", "--data", "synthetic", "--model", "resnet18"], ["3-channel", "cifar10"]),
    # train's models, not bench's (which listed gpt, then refused by train)
    (["train", "--data", "synthetic", "--model", "json:no_such_function"],
     ["'no_such_function'", "valid: mlp, cnn, resnet18, or package"]),
    (["train", "--data", "synthetic", "--policy", "bf17"], ["'bf17'", "valid:"]),
    (["train", "--data", "synthetic", "--opt-level", "O4"], ["'O4'", "O0", "O3"]),
    (["train", "--data", "cifar10"], ["--data-dir", "cifar-10-batches-py"]),
    (["train", "--data", "cifar10", "--data-dir", "/no/such/dir"], ["'/no/such/dir'", "valid:"]),
    (["train", "--data", "synthetic", "--resume"], ["--resume needs --checkpoint"]),
    (["train", "--data", "synthetic", "--epochs", "0"], ["--epochs", "0"]),
    # one file for two outputs: the JSON log replaced the checkpoint, the plot the JSON
    (["train", "--data", "synthetic", "--json", "/tmp/ampkit-same.pt", "--checkpoint",
      "/tmp/ampkit-same.pt"], ["--checkpoint and --json name the same file", "valid:"]),
    (["train", "--data", "synthetic", "--json", "/tmp/ampkit-same.pt", "--checkpoint",
      "/tmp/../tmp/ampkit-same.pt", "--resume"], ["name the same file"]),
    (["bench", "--model", "mlp", "--json", "/tmp/ampkit-same.png", "--plot",
      "/tmp/ampkit-same.png"], ["--plot and --json name the same file"]),
])
def test_bad_values_exit_2_with_one_line(capsys, argv, words):
    line = usage_error(capsys, *argv, "--quiet")
    for word in words:
        assert word in line, (word, line)


def test_an_unknown_option_is_reported_by_its_subcommand_with_the_closest_option(capsys):
    """argparse left a subcommand's unknown option to the top level: "ampkit: error: ...
    (see ampkit --help)", which lists no option of bench's."""
    assert usage_error(capsys, "bench", "--polices", "bf16-mixed") == (
        "ampkit bench: error: unrecognized arguments: --polices bf16-mixed; did you mean "
        "--policies? (see ampkit bench --help)")
    assert usage_error(capsys, "train", "--xyzzy", "--epochs", "1") == (
        "ampkit train: error: unrecognized arguments: --xyzzy (see ampkit train --help)")
    assert usage_error(capsys, "doctor", "--top=3", "--polcy=O2").startswith(
        "ampkit doctor: error: unrecognized arguments: --polcy=O2; did you mean --policy?")
    # The top level's own unknown option stays the top level's.
    assert usage_error(capsys, "--verison", "info") == (
        "ampkit: error: unrecognized arguments: --verison; did you mean --version? "
        "(see ampkit --help)")


@pytest.mark.parametrize("argv", [
    ["train", "--data", "synthetic", "--epochs", "2", "--batch-size", "256"],
    ["doctor", "--model", "mlp"],
    ["bench", *TINY, "--policies", "32-true", "--isolate", "never"]])
def test_a_closed_stdout_ends_the_command_quietly_with_sigpipes_status(argv):
    """`ampkit train | head -1`: the reader stopped reading, which is no failure of the run
    (it printed "ampkit train: failed: BrokenPipeError" and exited 1); a shell shows 141
    for a process SIGPIPE ended, and nothing is printed, not at the interpreter's exit either."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "ampkit.cli", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the first line: every write to stdout fails
    try:
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141, err
    finally:
        proc.kill()
    assert err == ""


def test_a_broken_pipe_with_captured_stdout_is_an_ordinary_failure(capsys, monkeypatch):
    """With no file descriptor behind stdout (a notebook, captured output), any broken pipe
    was taken for a closed stdout, and the redirect then let io.UnsupportedOperation out."""
    from ampkit.cli import info

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(info, "run", broken)
    monkeypatch.delenv("AMPKIT_DEBUG", raising=False)  # which would re-raise it
    assert main(["info"]) == 1  # capsys: sys.stdout has no fileno
    assert capsys.readouterr().err.startswith("ampkit info: failed: BrokenPipeError")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_names_the_valid_devices(capsys):
    line = usage_error(capsys, "bench", "--device", "cuda")
    assert "'cuda' is not available here" in line and "valid: cpu" in line


@pytest.mark.slow
def test_a_bad_value_shows_no_traceback_from_the_real_command():
    proc = run_cli("bench", "--policies", "O9")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("ampkit bench: error: unknown policy 'O9'")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_digits_without_scikit_learn_says_how_to_get_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    line = usage_error(capsys, "train", "--data", "digits", "--epochs", "1")
    assert "scikit-learn" in line and "--data synthetic" in line


# --- policies ------------------------------------------------------------------------------
def test_policy_list_splits_explicit_policies_and_resolves_opt_levels():
    specs = parse_policy_list("32-true,p=f32,c=bf16,o=f32,p=bf16,fp8-delayed,O2,O1-fp16", "cpu")
    assert [s.label for s in specs] == ["32-true", "p=f32,c=bf16,o=f32", "p=bf16",
                                        "fp8-delayed", "O2", "O1-fp16"]
    assert specs[1].policy.autocast and specs[1].policy.compute_dtype == torch.bfloat16
    assert specs[2].policy.param_dtype == torch.bfloat16
    assert specs[3].fp8_recipe == "delayed" and specs[3].policy.compute_dtype == torch.bfloat16
    assert specs[4].policy.param_dtype == torch.bfloat16  # O2 on a CPU: its autocast dtype
    assert specs[4].policy.master_weights
    assert specs[5].policy.compute_dtype == torch.float16
    assert [s.label for s in parse_policy_list("16-mixed;bf16-true", "cpu")] == ["16-mixed", "bf16-true"]
    with pytest.raises(UsageError, match="no policy given in ','"):
        parse_policy_list(",", "cpu")


def test_a_policy_named_twice_runs_once_under_its_first_name():
    """Two rows of one policy: the recommendation rule picked one, the sentence quoted the
    other's figures (a policy 0.37x the speed of fp32 "the fastest"), and "fp32" after
    "32-true" could be recommended over itself."""
    specs = parse_policy_list("32-true,bf16-mixed,fp32,bf16-mixed,O2,O2-bf16,fp8,fp8-tensorwise",
                              "cpu")
    assert [s.label for s in specs] == ["32-true", "bf16-mixed", "O2", "fp8"]


def test_loss_scaling_and_adam_eps_follow_the_policy():
    # One rule, the policy's (initialize applies the same): the apex opt levels are dynamic
    # in either half dtype, bf16-mixed and the fp32 policies do not scale.
    label = lambda name: loss_scaling_label(parse_policy(name, "cpu").policy)  # noqa: E731
    assert label("16-mixed") == "dynamic"
    assert label("O2") == "dynamic" and label("O1-bf16") == "dynamic"
    assert label("bf16-mixed") == "off" and label("32-true") == "off"
    assert label("p=f16,c=f16,o=f32,scale=128") == "static 128"
    assert adam_eps(parse_policy("16-true", "cpu").policy) == 1e-4
    assert adam_eps(parse_policy("O2-fp16", "cpu").policy) == 1e-8  # fp32 masters
    assert adam_eps(parse_policy("bf16-true", "cpu").policy) == 1e-8


# --- train ---------------------------------------------------------------------------------
def _epochs(log: dict) -> list[dict]:
    return [{k: v for k, v in record.items() if k != "time_s"} for record in log["epochs"]]


@pytest.mark.parametrize("policy", [
    "32-true", "O2-fp16", "fp8-delayed",  # plain; masters + dynamic scale; fp8 histories
    *(pytest.param(p, marks=pytest.mark.slow) for p in ("bf16-mixed", "16-true", "fp8"))])
def test_resume_continues_exactly(tmp_path, policy):
    ckpt = str(tmp_path / "run.pt")
    settings = TrainSettings(data="synthetic", policy=policy, epochs=2, batch_size=128)
    whole = train(settings)
    first = train(TrainSettings(**{**settings.__dict__, "epochs": 1}), checkpoint=ckpt)
    resumed = train(settings, checkpoint=ckpt, resume=True)
    assert resumed["resumed_from_epoch"] == 1 and first["final"]["epoch"] == 1
    assert _epochs(resumed) == _epochs(whole)  # bitwise: loss, accuracy, scale, skips


def test_resume_refuses_a_checkpoint_of_other_settings(tmp_path):
    ckpt = str(tmp_path / "run.pt")
    train(TrainSettings(data="synthetic", policy="32-true", epochs=1, batch_size=256), checkpoint=ckpt)
    with pytest.raises(UsageError, match="policy='32-true', this run has policy='bf16-mixed'"):
        train(TrainSettings(data="synthetic", policy="bf16-mixed", epochs=2, batch_size=256),
              checkpoint=ckpt, resume=True)
    with pytest.raises(UsageError, match="no checkpoint at"):
        train(TrainSettings(data="synthetic", epochs=2), checkpoint=ckpt + ".missing", resume=True)


def test_resume_refuses_fewer_epochs_than_done_and_a_foreign_file(tmp_path):
    """Fewer --epochs than the checkpoint finished trained nothing and exited 0; a file
    that is no checkpoint printed torch's advice to load it with weights_only=False."""
    ckpt = str(tmp_path / "run.pt")
    settings = TrainSettings(data="synthetic", policy="32-true", epochs=2, batch_size=256)
    train(settings, checkpoint=ckpt)
    with pytest.raises(UsageError, match=r"holds 2 finished epochs, more than --epochs 1; "
                                         r"valid: --epochs 2 or more"):
        train(TrainSettings(**{**settings.__dict__, "epochs": 1}), checkpoint=ckpt, resume=True)
    assert train(settings, checkpoint=ckpt, resume=True)["final"]["epoch"] == 2  # equal: done
    foreign = tmp_path / "foreign.pt"
    torch.save({"f": print}, foreign)  # a pickled function: code would run on a full load
    for path in (foreign, tmp_path / "garbage.pt"):
        if path.name == "garbage.pt":
            path.write_bytes(b"not a checkpoint" * 64)
        with pytest.raises(UsageError) as err:
            train(settings, checkpoint=str(path), resume=True)
        assert "is not a checkpoint ampkit train wrote" in str(err.value)
        assert "weights_only" not in str(err.value) and len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("argv, policy", [
    (["--policy", "bf16-mixed"], "with bf16-mixed on cpu"),  # was "bf16-mixed (bf16-mixed)"
    (["--opt-level", "O2"], "with O2 (p=bf16,c=bf16,o=f32,autocast=0,master=1,bn=1,"
                            "scale=dynamic) on cpu"),
    # was "fp8-delayed (bf16-mixed)", naming no fp8
    (["--policy", "fp8-delayed"], "with fp8-delayed (fp8-delayed Linear layers under "
                                  "bf16-mixed) on cpu")])
def test_train_header_names_the_resolved_policy_only_where_it_differs(capsys, argv, policy):
    assert main(["train", "--data", "synthetic", "--epochs", "1", "--batch-size", "256", "--quiet",
                 *argv]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header == f"ampkit train: mlp on synthetic {policy}"


@pytest.mark.slow
def test_train_command_checkpoint_and_resume_give_the_same_json(tmp_path):
    ckpt, whole, resumed = (str(tmp_path / n) for n in ("c.pt", "whole.json", "resumed.json"))
    common = ["train", "--data", "synthetic", "--opt-level", "O1", "--batch-size", "256", "--quiet"]
    assert main([*common, "--epochs", "2", "--json", whole]) == 0
    assert main([*common, "--epochs", "1", "--checkpoint", ckpt]) == 0
    proc = run_cli(*common, "--epochs", "2", "--checkpoint", ckpt, "--resume", "--json", resumed)
    assert proc.returncode == 0, proc.stderr
    assert "resumed after epoch 1" in proc.stdout and "epoch   2/2" in proc.stdout
    a, b = json.loads(Path(whole).read_text()), json.loads(Path(resumed).read_text())
    assert _epochs(a) == _epochs(b) and a["final"]["test_acc"] == b["final"]["test_acc"]
    # O1 on a CPU is bf16 autocast, with apex's dynamic loss scale as initialize gives it.
    assert b["resolved_policy"].startswith("p=f32,c=bf16,o=f32,autocast=1")
    assert b["loss_scaling"] == "dynamic" and b["environment"]["device"] == "cpu"


@pytest.mark.slow
@needs_sklearn
def test_every_policy_ends_within_one_point_of_fp32_on_digits():
    accuracy = {}
    for policy in ("32-true", "bf16-mixed", "16-mixed", "O2", "O2-fp16", "O3", "16-true",
                   "bf16-true", "fp8"):
        log = train(TrainSettings(data="digits", policy=policy, epochs=10))
        accuracy[policy] = log["final"]["test_acc"]
    reference = accuracy.pop("32-true")
    assert reference > 0.94
    assert {p: a for p, a in accuracy.items() if abs(a - reference) > 0.01} == {}, (reference, accuracy)


def test_bench_counts_each_policys_flops_by_the_dtype_they_ran_in():
    """The low-precision FLOP share (issue 12): from the ops that ran, not from the policy name."""
    settings = BenchSettings(model="mlp", steps=1, warmup=1)
    fp32 = run_policy(parse_policy("32-true", "cpu"), settings)
    bf16 = run_policy(parse_policy("bf16-mixed", "cpu"), settings)
    # 10-100-10 MLP, batch 100: forward 2*100*(10*100 + 100*10), backward twice that
    # (the first layer's input gradient is not computed: the input needs none).
    assert set(fp32["flops"]) == {"float32"} and fp32["low_precision_share"] == 0.0
    assert set(bf16["flops"]) == {"bfloat16"} and bf16["low_precision_share"] == 1.0
    assert fp32["flops"]["float32"] == bf16["flops"]["bfloat16"] == 2 * 100 * 2000 * 3 - 2 * 100 * 1000
    assert "100% of FLOPs <fp32" in report_notes(bf16) and "FLOPs" not in report_notes(fp32)


def report_notes(result):
    from ampkit.bench.verdict import notes

    return notes(result)


@pytest.mark.parametrize("argv", [
    ["bench", "--model", "nosuch", "--plot", "{d}/x.png"],
    ["bench", "--json", "{d}/x.json", "--lr", "-1"],
    ["train", "--checkpoint", "{d}/c.pt", "--epochs", "0"],
    ["tune", "--model", "nosuch", "--json", "{d}/r.json"],
])
def test_a_refused_run_leaves_no_output_folder_behind(tmp_path, capsys, argv):
    """The output paths were checked by making their folders: a run refused afterwards
    (exit 2) left them behind, empty."""
    folder = tmp_path / "new" / "deeper"
    assert main([a.format(d=folder) for a in argv]) == 2
    assert not (tmp_path / "new").exists()
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("version, words", [
    ("2.13.0+cpu", 'pip install "torchvision==0.28.*" --index-url https://download.pytorch.org/whl/cpu'),
    ("2.11.0+cu130", 'pip install "torchvision==0.26.*" --index-url https://download.pytorch.org/whl/cu130'),
    ("2.13.0", 'pip install "torchvision==0.28.*"'),
])
def test_the_torchvision_advice_names_the_release_of_the_installed_torch(monkeypatch, version, words):
    """'pip install torchvision' pulled the newest torch (a multi-GB CUDA build) over the
    user's CPU torch."""
    from ampkit.bench.errors import torchvision_install

    monkeypatch.setattr(torch, "__version__", version)
    assert torchvision_install() == words


def test_no_command_prints_the_help_to_stderr_and_exits_2(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "usage: ampkit" in captured.err


@pytest.mark.parametrize("command", [["train", "--data", "synthetic"], ["doctor"],
                                     ["tune"], ["bench"]])
def test_a_seed_beyond_int64_exits_2_naming_it(capsys, command):
    """It failed deep in torch (exit 1, 'Overflow when unpacking long long')."""
    assert main([*command, "--seed", str(2**64)]) == 2
    assert f"--seed {2**64} is out of range; valid: an integer in [-2**63, 2**63 - 1]" in \
        capsys.readouterr().err


def test_train_runs_a_small_model_on_one_thread_and_takes_threads(tmp_path, capsys):
    """train had no --threads and ran on torch's default: two OpenMP threads on a busy
    2-core machine made an epoch 20-40 times slower than one (new-user probe)."""
    before = torch.get_num_threads()
    out = tmp_path / "train.json"
    assert main(["train", "--data", "synthetic", "--epochs", "1", "--quiet", "--json",
                 str(out)]) == 0
    log = json.loads(out.read_text())
    assert log["threads"] == 1 and log["threads_reason"].startswith("1: a small model")
    assert torch.get_num_threads() == before  # restored
    assert main(["train", "--data", "synthetic", "--epochs", "1", "--quiet", "--threads", "1",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["threads_reason"] == "1, as asked (--threads)"
    capsys.readouterr()
    assert main(["train", "--threads", "0"]) == 2
    assert "--threads must be an int in [1, " in capsys.readouterr().err


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two logical cores")
def test_a_resume_runs_on_the_checkpoints_threads(tmp_path, capsys):
    """Another thread count rounds a CPU's sums differently: a checkpoint of a 2-thread run
    resumed on the new 1-thread default went on, not exactly (review finding)."""
    ckpt, log = str(tmp_path / "c.pt"), tmp_path / "resumed.json"
    common = ["train", "--data", "synthetic", "--batch-size", "256", "--quiet",
              "--checkpoint", ckpt]
    assert main([*common, "--epochs", "1", "--threads", "2"]) == 0
    capsys.readouterr()
    assert main([*common, "--epochs", "2", "--resume", "--threads", "1"]) == 2
    assert ("--threads 1: the checkpoint ran on 2 thread(s)" in capsys.readouterr().err)
    assert main([*common, "--epochs", "2", "--resume", "--json", str(log)]) == 0
    resumed = json.loads(log.read_text())
    assert resumed["threads"] == 2 and resumed["threads_reason"].startswith("2, the checkpoint's")


def test_train_takes_the_largest_seed(tmp_path, capsys):
    """Its per-epoch shuffle seed (seed * 1000003 + epoch) overflowed torch's int64."""
    assert main(["train", "--data", "synthetic", "--epochs", "1", "--quiet",
                 "--seed", str(2**63 - 1)]) == 0


def test_data_dir_without_cifar10_is_refused(capsys):
    """It was ignored silently, even a folder that does not exist."""
    assert main(["train", "--data-dir", "/nonexistent_dir", "--epochs", "1"]) == 2
    assert "--data-dir '/nonexistent_dir' is read only with --data cifar10" in capsys.readouterr().err


@pytest.mark.parametrize("spec, words", [
    ("./mymods.py:ok", "names a file; valid: its import name (the current folder is on the "
                       "path), e.g. mymods:ok"),
    ("pkg/mymods.py:ok", "e.g. pkg.mymods:ok"),
    ("json:__doc__", "has '__doc__', but it is not a function (type str)"),
])
def test_model_specs_that_name_files_or_non_functions_say_what_to_write(capsys, spec, words):
    assert main(["train", "--model", spec, "--data", "synthetic", "--epochs", "1"]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "tune", "doctor"])
def test_a_user_function_returning_a_half_model_is_refused_alike(tmp_path, monkeypatch, capsys,
                                                                 command):
    """doctor refused it (exit 2), tune failed after its header (exit 1), and bench ran,
    showing every other policy as non-finite and the cause at the bottom (exit 0)."""
    (tmp_path / "halfmods.py").write_text(textwrap.dedent("""\
        import torch

        def make():
            model = torch.nn.Sequential(torch.nn.Linear(8, 4)).half()
            return model, (torch.randn(16, 8), torch.randint(0, 4, (16,)))
        """))
    monkeypatch.chdir(tmp_path)
    assert main([command, "--model", "halfmods:make"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert ("model 'halfmods:make' returned a model whose parameter '0.weight' is "
            "torch.float16; the reference pass must be fp32" in captured.err)
